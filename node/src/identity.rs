//! Which cluster a node's data belongs to (DESIGN §68).
//!
//! Raft replicas trust each other's logs by index and term alone, so two histories that
//! share a prefix and then went separate ways — a cluster restored from last night's
//! backup set and the same cluster restored from tonight's, or one replica restored
//! from an old backup into the live cluster — look like one cluster to openraft: a
//! replica accepts an append whose previous entry is under its commit point (it trusts
//! committed entries to agree), and the states diverge silently.
//!
//! So a node's data dir carries the identity of the *cluster incarnation* it belongs to,
//! a 128-bit id in the meta column family:
//! - a new cluster's: derived from its initial members (`Admin.Init`, the same on every
//!   node it is sent to, so initialising shards through different nodes agrees, and a
//!   retried init derives the same id), stored before the shard is initialised;
//! - a restored cluster's: derived from the backup set and the members given to
//!   `allot-node restore` (the same on every node restored from the same set; a
//!   different set, or one node restored alone from an old one, is another cluster);
//! - a new or wiped node's (every shard empty, no id): adopted from the first
//!   authenticated peer message it gets;
//! - a data dir of a release before this one: none, as its peers' — those clusters keep
//!   working as before and gain an id when restored.
//!
//! Every peer message carries the sender's id (the `allot-cluster` header on gRPC, the
//! hello of a peer link), and a node refuses one whose id is not its own (none matches
//! none only), with reason `OTHER_CLUSTER`, before the message is read.

use rocksdb::DB;
use sha2::{Digest, Sha256};
use std::sync::{Arc, RwLock};

/// The gRPC metadata key a peer's cluster id travels in (32 lowercase hex digits).
pub const HEADER: &str = "allot-cluster";

pub type ClusterId = [u8; 16];

const KEY: &[u8] = b"cluster/identity";

/// The node's cluster id, and whether it may still adopt one.
pub struct Identity {
    db: Option<Arc<DB>>,
    state: RwLock<State>,
}

#[derive(Clone, Copy)]
struct State {
    id: Option<ClusterId>,
    /// No id stored and every shard opened empty: the first peer decides.
    fresh: bool,
}

fn key() -> Vec<u8> {
    crate::store::shard_key(u32::MAX, KEY)
}

/// The id stored in `db`, if any.
pub fn stored(db: &DB) -> anyhow::Result<Option<ClusterId>> {
    let meta = crate::store::cf(db, crate::store::CF_META);
    match db.get_cf(meta, key())? {
        None => Ok(None),
        Some(v) => Ok(Some(v.as_slice().try_into().map_err(|_| {
            anyhow::anyhow!("corrupt cluster id in the data dir ({} bytes)", v.len())
        })?)),
    }
}

/// Stores `id` in `db`, synced.
pub fn store(db: &DB, id: &ClusterId) -> anyhow::Result<()> {
    Ok(crate::store::meta_synced(db, &key(), Some(id))?)
}

fn derive(what: &[u8], parts: &[Vec<u8>]) -> ClusterId {
    let mut h = Sha256::new();
    h.update(b"allot cluster id\0");
    h.update(what);
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    let d = h.finalize();
    let mut id = [0u8; 16];
    id.copy_from_slice(&d[..16]);
    id
}

fn member_parts<'a>(members: impl Iterator<Item = (u64, &'a str)>) -> Vec<Vec<u8>> {
    let mut ms: Vec<(u64, &str)> = members.collect();
    ms.sort();
    ms.iter()
        .map(|(id, addr)| {
            let mut p = id.to_le_bytes().to_vec();
            p.extend_from_slice(addr.as_bytes());
            p
        })
        .collect()
}

/// A new cluster's id: from its initial members (ids and addresses, in id order).
pub fn of_genesis<'a>(members: impl Iterator<Item = (u64, &'a str)>) -> ClusterId {
    derive(b"genesis", &member_parts(members))
}

/// A restored cluster's id: from what each shard's backup holds (shard, log position,
/// state hash — not the file's bytes, which differ between layouts of one backup) and
/// the members the restore was given (none: the backed-up voters).
pub fn of_restore<'a>(
    shards: impl Iterator<Item = (u32, u64, u64, &'a [u8])>,
    members: Option<impl Iterator<Item = (u64, &'a str)>>,
) -> ClusterId {
    let mut parts: Vec<Vec<u8>> = Vec::new();
    let mut ss: Vec<(u32, u64, u64, &[u8])> = shards.collect();
    ss.sort();
    for (shard, term, index, hash) in ss {
        let mut p = shard.to_le_bytes().to_vec();
        p.extend_from_slice(&term.to_le_bytes());
        p.extend_from_slice(&index.to_le_bytes());
        p.extend_from_slice(hash);
        parts.push(p);
    }
    parts.push(b"members".to_vec());
    if let Some(m) = members {
        parts.extend(member_parts(m));
    }
    derive(b"restore", &parts)
}

pub fn hex(id: &ClusterId) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

/// A header's value: 32 hex digits, or `Err` for anything else.
pub fn parse(s: &[u8]) -> Result<ClusterId, String> {
    if s.len() != 32 {
        return Err(format!("a cluster id of {} characters", s.len()));
    }
    if !s.iter().all(u8::is_ascii_hexdigit) {
        return Err("a cluster id that is not hex".into());
    }
    let mut id = [0u8; 16];
    for (i, pair) in s.chunks(2).enumerate() {
        let text = std::str::from_utf8(pair).map_err(|_| "a cluster id that is not hex")?;
        id[i] = u8::from_str_radix(text, 16).map_err(|_| "a cluster id that is not hex")?;
    }
    Ok(id)
}

fn describe(id: &Option<ClusterId>) -> String {
    id.as_ref()
        .map_or("none (a data dir of an earlier release)".to_string(), hex)
}

impl Identity {
    /// The identity stored in `db` (none: not fresh until [`Identity::set_fresh`]).
    pub fn open(db: Arc<DB>) -> anyhow::Result<Identity> {
        let id = stored(&db)?;
        Ok(Identity {
            db: Some(db),
            state: RwLock::new(State { id, fresh: false }),
        })
    }

    /// An identity held in memory only (tests).
    pub fn in_memory(id: Option<ClusterId>, fresh: bool) -> Identity {
        Identity {
            db: None,
            state: RwLock::new(State { id, fresh }),
        }
    }

    fn read(&self) -> State {
        *self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Every shard opened empty: a node without an id adopts the first peer's.
    pub fn set_fresh(&self, every_shard_empty: bool) {
        let mut g = self.state.write().unwrap_or_else(|p| p.into_inner());
        g.fresh = every_shard_empty && g.id.is_none();
    }

    pub fn current(&self) -> Option<ClusterId> {
        self.read().id
    }

    fn persist(&self, id: &ClusterId) -> Result<(), String> {
        match &self.db {
            Some(db) => store(db, id).map_err(|e| format!("storing the cluster id: {e:#}")),
            None => Ok(()),
        }
    }

    /// A peer's message from cluster `theirs`: admitted when it is this node's cluster.
    /// A fresh node takes the first peer's id as its own.
    pub fn admit(&self, theirs: Option<ClusterId>) -> Result<(), String> {
        let s = self.read();
        if !s.fresh {
            return if s.id == theirs {
                Ok(())
            } else {
                Err(format!(
                    "the peer belongs to cluster {}, this node to cluster {}: a node restored \
                     from another backup set, or from an old backup into a live cluster, is \
                     not a member (DESIGN §68)",
                    describe(&theirs),
                    describe(&s.id)
                ))
            };
        }
        let mut g = self.state.write().unwrap_or_else(|p| p.into_inner());
        if g.fresh {
            if let Some(id) = &theirs {
                self.persist(id)?;
                tracing::info!(cluster = %hex(id), "this new node joins the cluster of its first peer");
            }
            g.id = theirs;
            g.fresh = false;
            return Ok(());
        }
        drop(g);
        self.admit(theirs)
    }

    /// `Admin.Init` on this node with the new cluster's id `genesis`. A node with no id
    /// whose shards are all empty (new, or one that heard only a peer without an id)
    /// takes it — before its shard is initialised, so its first vote requests carry it.
    /// `Err` when a shard would be initialised (`would_initialise`) on a node that
    /// belongs to another cluster; otherwise (a re-run init of an initialised cluster,
    /// of this release or an earlier one) nothing changes.
    pub fn initialise(
        &self,
        genesis: ClusterId,
        every_shard_empty: bool,
        would_initialise: bool,
    ) -> Result<(), String> {
        let mut g = self.state.write().unwrap_or_else(|p| p.into_inner());
        if g.fresh || (g.id.is_none() && every_shard_empty) {
            self.persist(&genesis)?;
            g.id = Some(genesis);
            g.fresh = false;
            return Ok(());
        }
        match g.id {
            Some(id) if id != genesis && would_initialise => Err(format!(
                "this node belongs to cluster {}, not to the new one ({}): it is not \
                 initialised into it",
                hex(&id),
                hex(&genesis)
            )),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_admits_its_own_cluster_only_and_a_fresh_one_adopts_the_first() {
        let a = of_genesis([(1, "h:1"), (2, "h:2")].into_iter());
        let b = of_genesis([(1, "h:1"), (3, "h:3")].into_iter());
        assert_ne!(a, b);
        let mine = Identity::in_memory(Some(a), false);
        assert!(mine.admit(Some(a)).is_ok());
        assert!(mine.admit(Some(b)).unwrap_err().contains(&hex(&b)));
        assert!(mine.admit(None).is_err());

        let legacy = Identity::in_memory(None, false);
        assert!(legacy.admit(None).is_ok());
        assert!(legacy.admit(Some(a)).is_err());

        let fresh = Identity::in_memory(None, true);
        assert!(fresh.admit(Some(b)).is_ok());
        assert_eq!(fresh.current(), Some(b));
        assert!(fresh.admit(Some(a)).is_err(), "adopted once, for good");
    }

    #[test]
    fn init_gives_a_fresh_node_the_new_id_and_is_idempotent_elsewhere() {
        let members = [(2, "h:2"), (1, "h:1")];
        let g = of_genesis(members.into_iter());
        assert_eq!(g, of_genesis(members.iter().rev().copied()), "order-free");
        let fresh = Identity::in_memory(None, true);
        fresh.initialise(g, true, true).unwrap();
        assert_eq!(fresh.current(), Some(g));
        fresh.initialise(g, false, true).unwrap();
        let other = of_genesis([(1, "h:1")].into_iter());
        // A re-run init with another id: nothing to initialise, nothing changes.
        fresh.initialise(other, false, false).unwrap();
        assert_eq!(fresh.current(), Some(g));
        // A shard to initialise on a node of another cluster: refused.
        assert!(fresh.initialise(other, false, true).is_err());
        // A data dir of an earlier release: its shards are initialised already.
        let legacy = Identity::in_memory(None, false);
        legacy.initialise(g, false, false).unwrap();
        assert_eq!(legacy.current(), None);
        // A new node that heard a peer without an id first, then the init.
        let heard_none = Identity::in_memory(None, true);
        heard_none.admit(None).unwrap();
        heard_none.initialise(g, true, true).unwrap();
        assert_eq!(heard_none.current(), Some(g));
    }

    #[test]
    fn a_restored_clusters_id_follows_the_backup_set_and_the_members() {
        let h1 = [1u8; 32];
        let h2 = [2u8; 32];
        let set = |h: &[u8; 32]| vec![(0u32, 3u64, 40u64, h.to_vec()), (1, 3, 41, h1.to_vec())];
        let members = [(1, "h:1"), (2, "h:2")];
        let id = |s: &Vec<(u32, u64, u64, Vec<u8>)>, m: Option<&[(u64, &str)]>| {
            of_restore(
                s.iter().map(|(a, b, c, d)| (*a, *b, *c, d.as_slice())),
                m.map(|m| m.iter().copied()),
            )
        };
        let one = id(&set(&h1), Some(&members));
        assert_eq!(one, id(&set(&h1), Some(&members)));
        let mut reversed = set(&h1);
        reversed.reverse();
        assert_eq!(one, id(&reversed, Some(&members)), "file order-free");
        assert_ne!(one, id(&set(&h2), Some(&members)), "another backup set");
        assert_ne!(one, id(&set(&h1), None), "other members");
        assert_ne!(
            one,
            of_genesis(members.iter().copied()),
            "never a genesis id"
        );
    }

    #[test]
    fn header_values_parse_as_32_hex_digits_only() {
        let id = of_genesis([(1, "h:1")].into_iter());
        assert_eq!(parse(hex(&id).as_bytes()), Ok(id));
        assert!(parse(b"").is_err());
        assert!(parse(&[b'z'; 32]).is_err());
        assert!(parse(&[b'a'; 31]).is_err());
        assert!(parse("+1".repeat(16).as_bytes()).is_err());
        assert!(parse("é".repeat(16).as_bytes()).is_err());
    }
}
