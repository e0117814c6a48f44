//! The idempotency table: `(actor, request_id) → (fingerprint, outcome)`, written in the
//! same apply as the command's effect, kept for a retention window of logical time.
//!
//! **Layout** (docs/DESIGN.md §51). Records are written in log order and leave in log
//! order (pruned by age), so they live in a *record log*: dense, fixed-size chunks of
//! [`CHUNK_RECORDS`] records, shared between the state and its snapshot clones
//! (`Arc`; a clone copies one pointer per chunk, a write after a clone copies only the
//! open tail chunk). A record is 48 bytes — request id, fingerprint, time, the actor as
//! a number in a small intern table, the end of its outcome in the chunk's byte arena —
//! plus its outcome in the codec's encoding (a few bytes for the common ones). The
//! lookup **index** maps a key to the record's sequence number: hash tables of `u32`
//! sequence numbers (about 5 bytes a slot), split into [`SEGMENTS`] so that growing one
//! rehashes a small part, hashed with random SipHash keys per table (a caller cannot
//! choose colliding request ids), compared against the record in the log.
//!
//! The index is derived data: it is not encoded, not compared, and not cloned — a clone
//! (a snapshot's copy) starts without one and builds it the first time it is written
//! or asked through the index ([`IdempotencyTable::get`] answers from a scan meanwhile).
//! So a snapshot costs no copy of the index, and the encoding is the records in log
//! order, which is canonical: replicas with different hash keys, or rebuilt from a
//! snapshot, encode and hash identically.

use crate::codec;
use crate::ids::{Actor, OrgId, RequestId};
use crate::limits::{
    IDEMPOTENCY_ENTRIES_MAX, IDEMPOTENCY_ENTRIES_MAX_V3, IDEMPOTENCY_RESERVED_MAX,
    PRUNE_PER_ENTRY_MAX,
};
use crate::outcome::Outcome;
use hashbrown::HashTable;
use serde::de::{self, DeserializeSeed, SeqAccess, Visitor};
use serde::ser::{SerializeSeq, SerializeTuple};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::collections::hash_map::RandomState;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::BuildHasher;
use std::sync::Arc;

pub type Fingerprint = [u8; 16];

/// The fingerprint of a command: the first 128 bits of its digest.
pub fn fingerprint(digest: &crate::audit::Hash32) -> Fingerprint {
    let mut fp = [0u8; 16];
    fp.copy_from_slice(&digest[..16]);
    fp
}

/// One record as callers see it (and as format 6 encoded it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdemRecord {
    pub fingerprint: Fingerprint,
    pub at_ms: u64,
    pub outcome: Outcome,
}

pub(crate) enum Lookup {
    New,
    Replay(Outcome),
    Conflict,
}

/// Records per chunk of the record log.
pub const CHUNK_RECORDS: usize = 1024;
/// Index segments (a power of two): growing a segment rehashes 1/`SEGMENTS` of the
/// records, so no single insert pays for rehashing the whole table.
pub const SEGMENTS: usize = 1024;
/// A segment this large that pruning left less than 1/8 full is shrunk.
const SEGMENT_SHRINK_MIN: usize = 1024;

/// A record in the log: 48 bytes.
#[derive(Clone, Copy, Debug)]
struct Slot {
    request_id: RequestId,
    fingerprint: Fingerprint,
    at_ms: u64,
    /// The actor's number in [`Actors`].
    actor: u32,
    /// End of this record's encoded outcome in its chunk's arena; it starts where the
    /// previous record's ends (or at 0).
    outcome_end: u32,
}

#[derive(Clone, Debug, Default)]
struct Chunk {
    slots: Vec<Slot>,
    arena: Vec<u8>,
}

impl Chunk {
    fn outcome_bytes(&self, i: usize) -> &[u8] {
        let start = match i {
            0 => 0,
            _ => self.slots[i - 1].outcome_end as usize,
        };
        &self.arena[start..self.slots[i].outcome_end as usize]
    }
}

/// The records in log order, in shared chunks.
#[derive(Clone, Debug, Default)]
struct RecordLog {
    chunks: VecDeque<Arc<Chunk>>,
    /// Records at the front of the first chunk already pruned.
    head: usize,
    /// Sequence number of the first chunk's first record (pruned or not).
    base_seq: u64,
}

impl RecordLog {
    /// Records ever pushed into the chunks held (pruned ones of the first included).
    fn span(&self) -> usize {
        match self.chunks.back() {
            None => 0,
            Some(last) => (self.chunks.len() - 1) * CHUNK_RECORDS + last.slots.len(),
        }
    }

    fn len(&self) -> usize {
        self.span() - self.head
    }

    fn next_seq(&self) -> u64 {
        self.base_seq + self.span() as u64
    }

    /// The live record with sequence number `seq`.
    fn get(&self, seq: u64) -> Option<(&Slot, &[u8])> {
        let pos = usize::try_from(seq.checked_sub(self.base_seq)?).ok()?;
        if pos < self.head || pos >= self.span() {
            return None;
        }
        let chunk = &self.chunks[pos / CHUNK_RECORDS];
        let i = pos % CHUNK_RECORDS;
        Some((&chunk.slots[i], chunk.outcome_bytes(i)))
    }

    /// The live record whose sequence number is `seq32` modulo 2^32 (the index's form:
    /// fewer than 2^32 records are ever live, so it names one record).
    fn seq_of(&self, seq32: u32) -> u64 {
        let first = self.base_seq + self.head as u64;
        first + seq32.wrapping_sub(first as u32) as u64
    }

    fn back(&self) -> Option<&Slot> {
        self.chunks.back().and_then(|c| c.slots.last())
    }

    fn front(&self) -> Option<(u64, &Slot)> {
        let first = self.chunks.front()?;
        first
            .slots
            .get(self.head)
            .map(|s| (self.base_seq + self.head as u64, s))
    }

    fn pop_front(&mut self) {
        self.head += 1;
        if self.head == CHUNK_RECORDS {
            self.chunks.pop_front();
            self.head = 0;
            self.base_seq += CHUNK_RECORDS as u64;
        } else if self.head == self.span() {
            // The last live record of a partly filled (tail) chunk: start afresh.
            self.chunks.clear();
            self.base_seq += self.head as u64;
            self.head = 0;
        }
    }

    /// Appends a record whose outcome `encode` writes into the arena; returns its
    /// sequence number.
    fn push(&mut self, mut slot: Slot, encode: impl FnOnce(&mut Vec<u8>)) -> u64 {
        let seq = self.next_seq();
        if self
            .chunks
            .back()
            .is_none_or(|c| c.slots.len() == CHUNK_RECORDS)
        {
            self.chunks.push_back(Arc::new(Chunk {
                slots: Vec::with_capacity(CHUNK_RECORDS),
                arena: Vec::new(),
            }));
        }
        let tail = match self.chunks.back_mut() {
            Some(tail) => Arc::make_mut(tail),
            None => unreachable!("a chunk was just ensured"),
        };
        encode(&mut tail.arena);
        slot.outcome_end = u32::try_from(tail.arena.len()).unwrap_or(u32::MAX);
        tail.slots.push(slot);
        if tail.slots.len() == CHUNK_RECORDS {
            // Sealed: it is never written again.
            tail.arena.shrink_to_fit();
        }
        seq
    }

    /// The live records, oldest first, with their sequence numbers.
    fn iter(&self) -> impl Iterator<Item = (u64, &Slot, &[u8])> + '_ {
        let base = self.base_seq;
        self.chunks.iter().enumerate().flat_map(move |(c, chunk)| {
            let from = if c == 0 { self.head } else { 0 };
            (from..chunk.slots.len()).map(move |i| {
                (
                    base + (c * CHUNK_RECORDS + i) as u64,
                    &chunk.slots[i],
                    chunk.outcome_bytes(i),
                )
            })
        })
    }

    /// Heap bytes held (chunks' capacity), for the benchmarks' accounting.
    fn heap_bytes(&self) -> usize {
        self.chunks
            .iter()
            .map(|c| {
                c.slots.capacity() * std::mem::size_of::<Slot>()
                    + c.arena.capacity()
                    + std::mem::size_of::<Chunk>()
            })
            .sum()
    }
}

/// The actors of live records, numbered: a record stores a `u32`, not a 40-byte actor.
/// Bounded by the actors that wrote in the retention window (principals, agents, the
/// operator; in dev mode, claimed identities).
#[derive(Clone, Debug, Default)]
struct Actors {
    /// `(actor, live records)`; a slot with no records is free.
    slots: Vec<(Actor, u32)>,
    free: Vec<u32>,
}

/// The lookup index (derived from the log; see the module docs).
#[derive(Debug, Default)]
struct Index {
    built: bool,
    hasher: RandomState,
    segments: Vec<HashTable<u32>>,
    actor_ix: HashMap<Actor, u32, RandomState>,
}

impl Index {
    fn hash(&self, actor: u32, id: RequestId) -> u64 {
        self.hasher.hash_one((actor, id))
    }
}

/// Segment of a hash: bits the segment's own table does not use for placement (its low
/// bits, below its capacity) or for its tags (the top seven).
fn segment_of(h: u64) -> usize {
    (h >> 32) as usize & (SEGMENTS - 1)
}

#[derive(Default)]
pub struct IdempotencyTable {
    pub retention_ms: u64,
    log: RecordLog,
    actors: Actors,
    /// Records per org (of its tenants' principals), against the org's quota.
    by_org: BTreeMap<OrgId, u32>,
    index: Index,
}

/// A clone shares the record log's chunks and leaves the index behind: it is built
/// again, from the log, only if the clone is written to.
impl Clone for IdempotencyTable {
    fn clone(&self) -> Self {
        IdempotencyTable {
            retention_ms: self.retention_ms,
            log: self.log.clone(),
            actors: self.actors.clone(),
            by_org: self.by_org.clone(),
            index: Index::default(),
        }
    }
}

/// Equal when they hold the same records in the same order (what they encode).
impl PartialEq for IdempotencyTable {
    fn eq(&self, other: &Self) -> bool {
        self.retention_ms == other.retention_ms
            && self.by_org == other.by_org
            && self.len() == other.len()
            && self.log.iter().zip(other.log.iter()).all(|(a, b)| {
                let (sa, sb) = (a.1, b.1);
                sa.request_id == sb.request_id
                    && sa.fingerprint == sb.fingerprint
                    && sa.at_ms == sb.at_ms
                    && self.actors.slots[sa.actor as usize].0
                        == other.actors.slots[sb.actor as usize].0
                    && a.2 == b.2
            })
    }
}

impl Eq for IdempotencyTable {}

impl std::fmt::Debug for IdempotencyTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyTable")
            .field("retention_ms", &self.retention_ms)
            .field("records", &self.len())
            .field("actors", &self.actors.slots.len())
            .field("by_org", &self.by_org)
            .finish()
    }
}

impl IdempotencyTable {
    pub fn new(retention_ms: u64) -> Self {
        IdempotencyTable {
            retention_ms,
            ..Default::default()
        }
    }

    /// Records held.
    pub fn len(&self) -> usize {
        self.log.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records held by `org`'s principals.
    pub fn of_org(&self, org: OrgId) -> u32 {
        self.by_org.get(&org).copied().unwrap_or(0)
    }

    /// The record of `(actor, id)`, if one is held.
    pub fn get(&self, actor: Actor, id: RequestId) -> Option<IdemRecord> {
        let seq = self.find(actor, id)?;
        let (slot, bytes) = self.log.get(seq)?;
        Some(IdemRecord {
            fingerprint: slot.fingerprint,
            at_ms: slot.at_ms,
            outcome: decode_outcome(bytes),
        })
    }

    /// Every record, oldest first.
    pub fn records(&self) -> impl Iterator<Item = (Actor, RequestId, IdemRecord)> + '_ {
        self.log.iter().map(|(_, slot, bytes)| {
            (
                self.actors.slots[slot.actor as usize].0,
                slot.request_id,
                IdemRecord {
                    fingerprint: slot.fingerprint,
                    at_ms: slot.at_ms,
                    outcome: decode_outcome(bytes),
                },
            )
        })
    }

    /// Heap bytes of the record log and the index as allocated (the benchmarks'
    /// per-record figure; the intern table and the org counters are not counted).
    pub fn heap_bytes(&self) -> usize {
        self.log.heap_bytes()
            + self
                .index
                .segments
                .iter()
                .map(|s| s.allocation_size())
                .sum::<usize>()
    }

    pub(crate) fn lookup(&mut self, actor: Actor, id: RequestId, fp: &Fingerprint) -> Lookup {
        self.ensure_index();
        let Some(seq) = self.find(actor, id) else {
            return Lookup::New;
        };
        match self.log.get(seq) {
            Some((slot, bytes)) if &slot.fingerprint == fp => Lookup::Replay(decode_outcome(bytes)),
            Some(_) => Lookup::Conflict,
            None => Lookup::New,
        }
    }

    /// Whether a new record is refused: for a tenant (`tenant`), once only the reserved
    /// room is left; for the operator, agents and the system, at the table's bound
    /// under rule version `rules`.
    pub(crate) fn is_full(&self, tenant: bool, rules: u32) -> bool {
        full_at(self.len(), tenant, rules)
    }

    pub(crate) fn insert(
        &mut self,
        actor: Actor,
        id: RequestId,
        fingerprint: Fingerprint,
        now: u64,
        outcome: &Outcome,
    ) {
        self.ensure_index();
        let ix = self.intern(actor);
        let slot = Slot {
            request_id: id,
            fingerprint,
            at_ms: now,
            actor: ix,
            outcome_end: 0,
        };
        let seq = self
            .log
            .push(slot, |arena| codec::encode_into(arena, outcome));
        self.index_insert(seq, ix, id);
        if let Some(org) = actor.org() {
            *self.by_org.entry(org).or_default() += 1;
        }
    }

    /// Drops records older than the retention window (bounded per entry).
    pub(crate) fn prune(&mut self, now: u64) {
        for _ in 0..PRUNE_PER_ENTRY_MAX {
            let (seq, actor, id) = match self.log.front() {
                Some((seq, s)) if s.at_ms.saturating_add(self.retention_ms) <= now => {
                    (seq, s.actor, s.request_id)
                }
                _ => return,
            };
            self.ensure_index();
            let h = self.index.hash(actor, id);
            let segment = &mut self.index.segments[segment_of(h)];
            if let Ok(entry) = segment.find_entry(h, |&s| s == seq as u32) {
                entry.remove();
            }
            // A segment emptied by pruning gives its room back (at most half is kept
            // free, so growing and shrinking stay amortised O(1)).
            if segment.capacity() > SEGMENT_SHRINK_MIN && segment.len() * 8 < segment.capacity() {
                let log = &self.log;
                let hasher = &self.index.hasher;
                segment.shrink_to(segment.len() * 2, |&s| rehash(hasher, log, s));
            }
            self.release(actor);
            self.log.pop_front();
        }
    }

    /// The sequence number of `(actor, id)`'s record: through the index when it is
    /// built, else by a scan of the log (a clone that was never written to).
    fn find(&self, actor: Actor, id: RequestId) -> Option<u64> {
        if !self.index.built {
            return self
                .log
                .iter()
                .find(|(_, s, _)| {
                    s.request_id == id && self.actors.slots[s.actor as usize].0 == actor
                })
                .map(|(seq, _, _)| seq);
        }
        let ix = *self.index.actor_ix.get(&actor)?;
        let h = self.index.hash(ix, id);
        let log = &self.log;
        self.index.segments[segment_of(h)]
            .find(h, |&s| {
                log.get(log.seq_of(s))
                    .is_some_and(|(slot, _)| slot.actor == ix && slot.request_id == id)
            })
            .map(|&s| log.seq_of(s))
    }

    fn index_insert(&mut self, seq: u64, actor: u32, id: RequestId) {
        index_insert(&mut self.index, &self.log, seq, actor, id);
    }

    /// Builds the index from the log (after a clone or a decode).
    fn ensure_index(&mut self) {
        if self.index.built {
            return;
        }
        let mut index = Index {
            built: true,
            hasher: RandomState::new(),
            segments: (0..SEGMENTS).map(|_| HashTable::new()).collect(),
            actor_ix: HashMap::default(),
        };
        for (ix, (actor, n)) in self.actors.slots.iter().enumerate() {
            if *n > 0 {
                index.actor_ix.insert(*actor, ix as u32);
            }
        }
        let per_segment = self.log.len() / SEGMENTS + 1;
        for segment in &mut index.segments {
            segment.reserve(per_segment, |_| 0);
        }
        for (seq, s, _) in self.log.iter() {
            index_insert(&mut index, &self.log, seq, s.actor, s.request_id);
        }
        self.index = index;
    }

    /// The actor's number, counting one more record of it.
    fn intern(&mut self, actor: Actor) -> u32 {
        if let Some(&ix) = self.index.actor_ix.get(&actor) {
            self.actors.slots[ix as usize].1 += 1;
            return ix;
        }
        let ix = match self.actors.free.pop() {
            Some(ix) => {
                self.actors.slots[ix as usize] = (actor, 1);
                ix
            }
            None => {
                self.actors.slots.push((actor, 1));
                (self.actors.slots.len() - 1) as u32
            }
        };
        self.index.actor_ix.insert(actor, ix);
        ix
    }

    /// One record of actor `ix` left: its counters go down, its number is freed with
    /// its last record.
    fn release(&mut self, ix: u32) {
        let (actor, n) = &mut self.actors.slots[ix as usize];
        let actor = *actor;
        *n -= 1;
        if *n == 0 {
            self.actors.free.push(ix);
            self.index.actor_ix.remove(&actor);
        }
        if let Some(org) = actor.org() {
            if let Some(c) = self.by_org.get_mut(&org) {
                *c -= 1;
                if *c == 0 {
                    self.by_org.remove(&org);
                }
            }
        }
    }

    /// Appends a decoded record, checking what the encoding must guarantee: time order
    /// and one record per key.
    fn push_decoded(
        &mut self,
        actor: Actor,
        id: RequestId,
        record: IdemRecordBytes,
    ) -> Result<(), String> {
        if self
            .log
            .back()
            .is_some_and(|last| record.at_ms < last.at_ms)
        {
            return Err("idempotency records out of time order".into());
        }
        if self.find(actor, id).is_some() {
            return Err("duplicate key in the idempotency table".into());
        }
        let ix = self.intern(actor);
        let slot = Slot {
            request_id: id,
            fingerprint: record.fingerprint,
            at_ms: record.at_ms,
            actor: ix,
            outcome_end: 0,
        };
        let seq = self
            .log
            .push(slot, |arena| arena.extend_from_slice(&record.outcome));
        self.index_insert(seq, ix, id);
        if let Some(org) = actor.org() {
            *self.by_org.entry(org).or_default() += 1;
        }
        Ok(())
    }

    /// An empty table whose index is built, to decode records into.
    fn decoding(retention_ms: u64) -> Self {
        let mut t = IdempotencyTable::new(retention_ms);
        t.ensure_index();
        t
    }

    /// The records' actors numbered by first appearance in the log (the canonical
    /// numbering of the encoding), and each intern slot's canonical number.
    fn canonical_actors(&self) -> (Vec<Actor>, Vec<u32>) {
        let mut remap = vec![u32::MAX; self.actors.slots.len()];
        let mut order = Vec::new();
        for (_, s, _) in self.log.iter() {
            let r = &mut remap[s.actor as usize];
            if *r == u32::MAX {
                *r = order.len() as u32;
                order.push(self.actors.slots[s.actor as usize].0);
            }
        }
        (order, remap)
    }

    /// The encoding of format 7 on (rule version 3): see [`Compact`].
    pub fn compact(&self) -> Compact<'_> {
        Compact(self)
    }

    /// The encoding of formats 5 and 6: see [`LayoutV6`].
    pub fn layout_v6(&self) -> LayoutV6<'_> {
        LayoutV6(self)
    }
}

/// Adds record `seq` of `(actor, id)` to the index.
fn index_insert(index: &mut Index, log: &RecordLog, seq: u64, actor: u32, id: RequestId) {
    let Index {
        hasher, segments, ..
    } = index;
    let h = hasher.hash_one((actor, id));
    segments[segment_of(h)].insert_unique(h, seq as u32, |&s| rehash(hasher, log, s));
}

/// The hash of the record an index slot names (to move it when a segment is resized).
fn rehash(hasher: &RandomState, log: &RecordLog, seq32: u32) -> u64 {
    log.get(log.seq_of(seq32)).map_or(0, |(slot, _)| {
        hasher.hash_one((slot.actor, slot.request_id))
    })
}

/// Decodes an outcome the table encoded (or checked when it was decoded).
fn decode_outcome(bytes: &[u8]) -> Outcome {
    match codec::decode_body(bytes) {
        Ok(outcome) => outcome,
        Err(e) => unreachable!("a stored outcome was encoded or checked by this table: {e}"),
    }
}

/// Whether a table of `len` records takes no new record from a tenant (`tenant`) or from
/// anyone else, under rule version `rules` (version 3 raised the bound 4×).
fn full_at(len: usize, tenant: bool, rules: u32) -> bool {
    let max = if rules >= 3 {
        IDEMPOTENCY_ENTRIES_MAX_V3
    } else {
        IDEMPOTENCY_ENTRIES_MAX
    };
    let bound = if tenant {
        max - IDEMPOTENCY_RESERVED_MAX
    } else {
        max
    };
    len >= bound
}

// ---- Encodings -------------------------------------------------------------------

/// The format-7 encoding: `(retention_ms, actors, records)` with the actors in order of
/// first appearance and each record `(actor number, request id, fingerprint, at_ms,
/// outcome bytes)` in log order. The org counters are derived, not encoded.
pub struct Compact<'a>(&'a IdempotencyTable);

/// An outcome already in the codec's encoding, written as a byte string.
struct Raw<'a>(&'a [u8]);

impl Serialize for Raw<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(self.0)
    }
}

impl Serialize for Compact<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let table = self.0;
        let (actors, remap) = table.canonical_actors();
        let mut t = s.serialize_tuple(3)?;
        t.serialize_element(&table.retention_ms)?;
        t.serialize_element(&actors)?;
        t.serialize_element(&Records {
            table,
            remap: &remap,
        })?;
        t.end()
    }
}

struct Records<'a> {
    table: &'a IdempotencyTable,
    remap: &'a [u32],
}

impl Serialize for Records<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.table.len()))?;
        for (_, slot, bytes) in self.table.log.iter() {
            seq.serialize_element(&(
                self.remap[slot.actor as usize],
                slot.request_id,
                slot.fingerprint,
                slot.at_ms,
                Raw(bytes),
            ))?;
        }
        seq.end()
    }
}

/// A record as decoded, its outcome still in encoded form (checked to decode).
struct IdemRecordBytes {
    fingerprint: Fingerprint,
    at_ms: u64,
    outcome: Vec<u8>,
}

/// An encoded outcome, checked to be one outcome and nothing more.
struct OutcomeBytes(Vec<u8>);

impl<'de> Deserialize<'de> for OutcomeBytes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Vec<u8>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an encoded outcome")
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }
            fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
                Ok(v)
            }
        }
        let bytes = d.deserialize_byte_buf(V)?;
        let _: Outcome = codec::decode_body(&bytes)
            .map_err(|e| de::Error::custom(format!("stored outcome: {e}")))?;
        Ok(OutcomeBytes(bytes))
    }
}

impl<'de> Deserialize<'de> for IdempotencyTable {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = IdempotencyTable;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("the idempotency table")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let missing = || de::Error::custom("idempotency table: missing field");
                let retention_ms: u64 = seq.next_element()?.ok_or_else(missing)?;
                let actors: Vec<Actor> = seq.next_element()?.ok_or_else(missing)?;
                let table = IdempotencyTable::decoding(retention_ms);
                seq.next_element_seed(RecordsInto { table, actors })?
                    .ok_or_else(missing)
            }
        }
        d.deserialize_tuple(3, V)
    }
}

/// Decodes the records straight into the table, one at a time (a large snapshot is
/// never held twice).
struct RecordsInto {
    table: IdempotencyTable,
    actors: Vec<Actor>,
}

impl<'de> DeserializeSeed<'de> for RecordsInto {
    type Value = IdempotencyTable;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for RecordsInto {
    type Value = IdempotencyTable;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("idempotency records")
    }
    fn visit_seq<A: SeqAccess<'de>>(mut self, mut seq: A) -> Result<Self::Value, A::Error> {
        type Rec = (u32, RequestId, Fingerprint, u64, OutcomeBytes);
        while let Some((actor, id, fingerprint, at_ms, outcome)) = seq.next_element::<Rec>()? {
            let actor = *self
                .actors
                .get(actor as usize)
                .ok_or_else(|| de::Error::custom("idempotency record: unknown actor number"))?;
            let record = IdemRecordBytes {
                fingerprint,
                at_ms,
                outcome: outcome.0,
            };
            self.table
                .push_decoded(actor, id, record)
                .map_err(de::Error::custom)?;
        }
        Ok(self.table)
    }
}

/// The layout formats 5 and 6 wrote (`IdempotencyTable` was then a struct of a persistent
/// map, its pruning queue and the org counters): the records sorted by key, the queue in
/// log order, the counters. Written while the shard's rule version is below 3, so that
/// the previous release reads this release's snapshots until the new rules are
/// activated (docs/DESIGN.md §51); costs a sort of the keys.
pub struct LayoutV6<'a>(&'a IdempotencyTable);

impl Serialize for LayoutV6<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let table = self.0;
        let actor = |slot: &Slot| table.actors.slots[slot.actor as usize].0;
        let mut sorted: Vec<u64> = table.log.iter().map(|(seq, _, _)| seq).collect();
        let slot = |seq: u64| match table.log.get(seq) {
            Some(x) => x,
            None => unreachable!("a live sequence number"),
        };
        sorted.sort_unstable_by(|a, b| {
            let (sa, sb) = (slot(*a).0, slot(*b).0);
            (actor(sa), sa.request_id).cmp(&(actor(sb), sb.request_id))
        });
        let mut t = s.serialize_tuple(4)?;
        t.serialize_element(&table.retention_ms)?;
        t.serialize_element(&SeqOf(sorted.len(), || {
            sorted.iter().map(|&seq| {
                let (s, bytes) = slot(seq);
                (
                    (actor(s), s.request_id),
                    IdemRecord {
                        fingerprint: s.fingerprint,
                        at_ms: s.at_ms,
                        outcome: decode_outcome(bytes),
                    },
                )
            })
        }))?;
        t.serialize_element(&SeqOf(table.len(), || {
            table
                .log
                .iter()
                .map(|(_, s, _)| (s.at_ms, actor(s), s.request_id))
        }))?;
        t.serialize_element(&table.by_org)?;
        t.end()
    }
}

/// A sequence of `len` items made by `items` as it is written.
struct SeqOf<F>(usize, F);

impl<F, I, T> Serialize for SeqOf<F>
where
    F: Fn() -> I,
    I: Iterator<Item = T>,
    T: Serialize,
{
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut seq = s.serialize_seq(Some(self.0))?;
        for item in (self.1)() {
            seq.serialize_element(&item)?;
        }
        seq.end()
    }
}

/// Reads the layout of formats 5 and 6 into the table (see [`LayoutV6`]); every record
/// must be in the queue once, and the counters must be the records'.
pub struct FromV6(pub IdempotencyTable);

impl<'de> Deserialize<'de> for FromV6 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Old {
            retention_ms: u64,
            records: Vec<((Actor, RequestId), IdemRecord)>,
            queue: Vec<(u64, Actor, RequestId)>,
            by_org: BTreeMap<OrgId, u32>,
        }
        let old = Old::deserialize(d)?;
        let mut records: HashMap<(Actor, RequestId), IdemRecord> =
            HashMap::with_capacity(old.records.len());
        for (k, r) in old.records {
            if records.insert(k, r).is_some() {
                return Err(de::Error::custom("duplicate key in map"));
            }
        }
        let mut table = IdempotencyTable::decoding(old.retention_ms);
        for (at, actor, id) in old.queue {
            let r = records
                .remove(&(actor, id))
                .filter(|r| r.at_ms == at)
                .ok_or_else(|| de::Error::custom("idempotency queue names no record"))?;
            let mut outcome = Vec::new();
            codec::encode_into(&mut outcome, &r.outcome);
            let record = IdemRecordBytes {
                fingerprint: r.fingerprint,
                at_ms: r.at_ms,
                outcome,
            };
            table
                .push_decoded(actor, id, record)
                .map_err(de::Error::custom)?;
        }
        if !records.is_empty() || table.by_org != old.by_org {
            return Err(de::Error::custom(
                "idempotency records, queue and counters disagree",
            ));
        }
        Ok(FromV6(table))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::PrincipalId;
    use crate::outcome::{CommandError, Reply};

    /// Tenants together stop at the reserve; the operator and agents go on to the bound.
    #[test]
    fn tenants_never_take_the_reserved_room() {
        for (rules, max) in [
            (1, IDEMPOTENCY_ENTRIES_MAX),
            (3, IDEMPOTENCY_ENTRIES_MAX_V3),
        ] {
            let tenants_stop = max - IDEMPOTENCY_RESERVED_MAX;
            assert!(!full_at(tenants_stop - 1, true, rules));
            assert!(full_at(tenants_stop, true, rules));
            assert!(!full_at(tenants_stop, false, rules));
            assert!(!full_at(max - 1, false, rules));
            assert!(full_at(max, false, rules));
        }
        assert_eq!(IDEMPOTENCY_ENTRIES_MAX_V3, 4 * IDEMPOTENCY_ENTRIES_MAX);
        // Sixteen orgs at the default records quota fit below the tenants' bound.
        let quota = crate::command::Quota::default().records_max as usize;
        let tenants_stop = IDEMPOTENCY_ENTRIES_MAX - IDEMPOTENCY_RESERVED_MAX;
        assert!(16 * quota <= tenants_stop, "{}", 16 * quota);
    }

    fn tenant(org: u64, p: u64) -> Actor {
        Actor::Tenant {
            org: OrgId(org),
            principal: PrincipalId(p),
        }
    }

    fn outcome(i: u64) -> Outcome {
        match i % 3 {
            0 => Ok(Reply::Created),
            1 => Ok(Reply::Captured {
                captured_micro: i,
                held_micro: i * 7,
            }),
            _ => Err(CommandError::InsufficientCredits {
                available: i,
                needed: i + 1,
            }),
        }
    }

    fn fp(i: u64) -> Fingerprint {
        let mut f = [0u8; 16];
        f[..8].copy_from_slice(&i.to_le_bytes());
        f
    }

    /// A table of `n` records by three actors (two orgs and the operator), one a second.
    fn table(n: u64) -> IdempotencyTable {
        let mut t = IdempotencyTable::new(1_000_000);
        let admin = Actor::Admin(PrincipalId(1));
        for i in 0..n {
            let actor = [tenant(7, 1), tenant(8, 2), admin][(i % 3) as usize];
            t.insert(actor, i as u128 * 31, fp(i), 1_000 * i, &outcome(i));
        }
        t
    }

    fn check_lookup(t: &mut IdempotencyTable, actor: Actor, id: RequestId, f: Fingerprint) -> u8 {
        match t.lookup(actor, id, &f) {
            Lookup::New => 0,
            Lookup::Replay(_) => 1,
            Lookup::Conflict => 2,
        }
    }

    #[test]
    fn a_record_is_found_by_its_actor_and_id_only() {
        let mut t = table(5_000);
        for i in [0u64, 1, 2, 1023, 1024, 2047, 4999] {
            let actor =
                [tenant(7, 1), tenant(8, 2), Actor::Admin(PrincipalId(1))][(i % 3) as usize];
            let id = i as u128 * 31;
            assert_eq!(check_lookup(&mut t, actor, id, fp(i)), 1, "record {i}");
            assert_eq!(
                check_lookup(&mut t, actor, id, fp(i + 1)),
                2,
                "conflict {i}"
            );
            assert_eq!(t.get(actor, id).map(|r| r.outcome), Some(outcome(i)));
            // The same id under another actor is another key.
            assert_eq!(check_lookup(&mut t, tenant(9, 9), id, fp(i)), 0);
        }
        assert_eq!(t.len(), 5_000);
        assert_eq!(t.of_org(OrgId(7)), 1_667);
        assert_eq!(t.of_org(OrgId(8)), 1_667);
    }

    #[test]
    fn pruning_drops_the_oldest_in_order_and_frees_their_keys_and_counts() {
        let mut t = table(3_000);
        // Records at 0..=1_999_000 ms are due at `now` = 2_999_999 (retention 1,000 s).
        t.prune(2_999_999);
        assert_eq!(t.len(), 1_000);
        assert_eq!(check_lookup(&mut t, tenant(7, 1), 0, fp(0)), 0);
        assert_eq!(check_lookup(&mut t, tenant(7, 1), 2_001 * 31, fp(2_001)), 1);
        assert_eq!(t.of_org(OrgId(7)) + t.of_org(OrgId(8)), 666);
        t.prune(u64::MAX);
        assert!(t.is_empty());
        assert!(t.by_org.is_empty());
        assert!(t.actors.slots.iter().all(|(_, n)| *n == 0));
        // Emptied, it takes records again (sequence numbers go on).
        t.insert(tenant(7, 1), 5, fp(5), 9, &outcome(5));
        assert_eq!(check_lookup(&mut t, tenant(7, 1), 5, fp(5)), 1);
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn a_clone_shares_the_log_and_rebuilds_its_index_when_written() {
        let t = table(2_500);
        let mut c = t.clone();
        assert!(!c.index.built);
        assert_eq!(c, t);
        // Read before the index exists (a scan), then written (the index is built).
        assert_eq!(
            c.get(tenant(8, 2), 31),
            Some(IdemRecord {
                fingerprint: fp(1),
                at_ms: 1_000,
                outcome: outcome(1)
            })
        );
        c.insert(tenant(8, 2), 1, fp(1), 2_500_000, &outcome(1));
        assert!(c.index.built);
        assert_eq!(check_lookup(&mut c, tenant(8, 2), 31, fp(1)), 1);
        assert_eq!(c.len(), 2_501);
        assert_eq!(t.len(), 2_500, "the original is untouched");
    }

    fn roundtrip<T: Serialize>(value: &T) -> Vec<u8> {
        let mut b = Vec::new();
        codec::encode_into(&mut b, value);
        b
    }

    #[test]
    fn both_encodings_read_back_to_the_same_records_whatever_the_hash_keys() {
        let mut t = table(3_100);
        t.prune(1_500_000);
        let compact = roundtrip(&t.compact());
        let back: IdempotencyTable = codec::decode_body_from(&mut &compact[..]).unwrap();
        assert_eq!(back, t);
        assert_eq!(roundtrip(&back.compact()), compact, "canonical");
        let v6 = roundtrip(&t.layout_v6());
        let FromV6(old) = codec::decode_body_from(&mut &v6[..]).unwrap();
        assert_eq!(old, t);
        assert_eq!(roundtrip(&old.layout_v6()), v6, "canonical");
        // A table built in another order of actors encodes the same.
        assert_eq!(roundtrip(&old.compact()), compact);
    }

    /// The layout formats 5 and 6 wrote, byte for byte: the struct of a sorted map, the
    /// queue in log order and the counters, as serde derived it.
    #[test]
    fn the_v6_layout_is_what_the_previous_release_wrote() {
        #[derive(Serialize)]
        struct Old {
            retention_ms: u64,
            records: BTreeMap<(Actor, RequestId), IdemRecord>,
            queue: Vec<(u64, Actor, RequestId)>,
            by_org: BTreeMap<OrgId, u32>,
        }
        let t = table(700);
        let old = Old {
            retention_ms: t.retention_ms,
            records: t.records().map(|(a, id, r)| ((a, id), r)).collect(),
            queue: t.records().map(|(a, id, r)| (r.at_ms, a, id)).collect(),
            by_org: t.by_org.clone(),
        };
        assert_eq!(roundtrip(&t.layout_v6()), roundtrip(&old));
    }

    #[test]
    fn malformed_encodings_are_refused() {
        let t = table(10);
        let good = roundtrip(&t.compact());
        // Every truncation.
        for len in 0..good.len() {
            assert!(
                codec::decode_body_from::<IdempotencyTable, _>(&mut &good[..len]).is_err(),
                "{len}"
            );
        }
        // A duplicate key, an unknown actor number, records out of time order.
        let rec = |a: u32, id: u128, at: u64| (a, id, fp(1), at, Raw(&[0u8, 0]));
        let dup = roundtrip(&(5u64, vec![tenant(7, 1)], vec![rec(0, 1, 1), rec(0, 1, 2)]));
        let unknown = roundtrip(&(5u64, vec![tenant(7, 1)], vec![rec(1, 1, 1)]));
        let unordered = roundtrip(&(5u64, vec![tenant(7, 1)], vec![rec(0, 1, 2), rec(0, 2, 1)]));
        let ok = roundtrip(&(5u64, vec![tenant(7, 1)], vec![rec(0, 1, 1), rec(0, 2, 1)]));
        for (bytes, want) in [
            (dup, false),
            (unknown, false),
            (unordered, false),
            (ok, true),
        ] {
            let r = codec::decode_body_from::<IdempotencyTable, _>(&mut &bytes[..]);
            assert_eq!(r.is_ok(), want, "{r:?}");
        }
        // An outcome that does not decode, or has bytes after it.
        let bad = roundtrip(&(
            5u64,
            vec![tenant(7, 1)],
            vec![(0u32, 1u128, fp(1), 1u64, Raw(&[0xff]))],
        ));
        assert!(codec::decode_body_from::<IdempotencyTable, _>(&mut &bad[..]).is_err());
        let long = roundtrip(&(
            5u64,
            vec![tenant(7, 1)],
            vec![(0u32, 1u128, fp(1), 1u64, Raw(&[0, 0, 0]))],
        ));
        assert!(codec::decode_body_from::<IdempotencyTable, _>(&mut &long[..]).is_err());
    }

    #[test]
    fn a_record_costs_about_fifty_bytes_plus_its_outcome() {
        let t = table(100_000);
        let mut c = t.clone();
        c.ensure_index();
        let per = c.heap_bytes() as f64 / c.len() as f64;
        assert!(per < 72.0, "{per} bytes per record");
        assert_eq!(std::mem::size_of::<Slot>(), 48);
    }
}
