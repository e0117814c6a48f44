//! `IdMap`: the state's point-lookup tables. A hash map whose encoding is the entries
//! *sorted by key* — so snapshots and `state_hash` stay canonical however the map was
//! built (log replay or snapshot restore).
//!
//! **Keyed hashing.** Most keys are chosen by callers (request ids, hold and job ids,
//! token digests), so an unkeyed hash lets a caller pick ids that collide and make
//! every insert and lookup O(n) on every replica at once. Each map therefore hashes
//! with its own random SipHash-1-3 keys (`std`'s `RandomState`): a caller cannot know
//! which ids collide. The keys differ between maps and between replicas, which is safe
//! because nothing observable depends on a hash table's layout — apply never iterates a
//! map in hash order where the order matters, and the encoding is sorted. The
//! determinism tests hold replicas whose maps hash differently, so they would catch a
//! use of hash order. (Rejected: a per-shard secret seed replicated through the log —
//! needed only if replicas had to hash alike, and a secret in every snapshot and
//! backup; ordered maps — O(log n) lookups on the hottest tables.)
//!
//! [`SharedMap`] and [`SharedQueue`] are the persistent (structurally shared) variants
//! for the tables that grow with traffic history — the idempotency table and its
//! pruning queue: cloning them is O(1), so a snapshot can take a consistent copy of the
//! state without holding apply back for a copy of every record. They encode exactly like
//! `IdMap` and `VecDeque`, so the choice does not show in snapshots or state hashes.
//! [`SharedSet`] is the persistent ordered set (tombstone indexes), encoded like a
//! `BTreeSet`.
//!
//! Invariant: apply never depends on an `IdMap`'s iteration order. Anything that must
//! be visited in order keeps its own ordered index (spend lists, the expiry queue, the
//! settled and idempotency queues). Order-insensitive reads (sums in invariant checks)
//! may iterate; [`IdMap::sorted`] gives a canonical order where one is needed.

use serde::de::{Deserialize, Deserializer};
use serde::ser::{Serialize, Serializer};
use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::Hash;
use std::ops::{Deref, DerefMut};

/// The hasher of every state table: SipHash-1-3 with random keys per map.
pub type Keyed = RandomState;

#[derive(Clone, Debug)]
pub struct IdMap<K: Hash + Eq, V>(HashMap<K, V, Keyed>);

impl<K: Hash + Eq, V: PartialEq> PartialEq for IdMap<K, V> {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}

impl<K: Hash + Eq, V: Eq> Eq for IdMap<K, V> {}

impl<K: Hash + Eq, V> Default for IdMap<K, V> {
    fn default() -> Self {
        IdMap(HashMap::default())
    }
}

impl<K: Hash + Eq, V> Deref for IdMap<K, V> {
    type Target = HashMap<K, V, Keyed>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl<K: Hash + Eq, V> DerefMut for IdMap<K, V> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl<K: Hash + Eq + Ord, V> IdMap<K, V> {
    /// The entries in key order.
    pub fn sorted(&self) -> Vec<(&K, &V)> {
        sorted(self.0.iter())
    }
}

/// Entries in key order: the canonical encoding of both map kinds.
fn sorted<'a, K: Ord + 'a, V: 'a>(
    entries: impl Iterator<Item = (&'a K, &'a V)>,
) -> Vec<(&'a K, &'a V)> {
    let mut v: Vec<(&K, &V)> = entries.collect();
    v.sort_unstable_by(|a, b| a.0.cmp(b.0));
    v
}

/// Decodes the canonical encoding into `map` through `insert` (which returns whether
/// the key was already present): a duplicate key is an error, never a silent overwrite.
fn decode_entries<'de, D: Deserializer<'de>, K: Deserialize<'de>, V: Deserialize<'de>, M>(
    d: D,
    map: &mut M,
    insert: impl Fn(&mut M, K, V) -> bool,
) -> Result<(), D::Error> {
    for (k, v) in Vec::<(K, V)>::deserialize(d)? {
        if insert(map, k, v) {
            return Err(serde::de::Error::custom("duplicate key in map"));
        }
    }
    Ok(())
}

impl<K: Hash + Eq + Ord + Serialize, V: Serialize> Serialize for IdMap<K, V> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.sorted())
    }
}

impl<'de, K: Hash + Eq + Deserialize<'de>, V: Deserialize<'de>> Deserialize<'de> for IdMap<K, V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut map = IdMap::default();
        decode_entries(d, &mut map.0, |m, k, v| m.insert(k, v).is_some())?;
        Ok(map)
    }
}

type Shared = imbl::shared_ptr::DefaultSharedPtr;

/// A persistent hash map with [`IdMap`]'s kind of hasher and encoding: a clone shares every node
/// with the original (O(1)); a write after a clone copies only the path to the entry it
/// changes. Lookups cost about twice an `IdMap`'s, so it is used only where a table
/// grows with history and is mostly written once (see the module docs).
#[derive(Clone, Debug)]
pub struct SharedMap<K: Hash + Eq + Clone, V: Clone>(imbl::GenericHashMap<K, V, Keyed, Shared>);

impl<K: Hash + Eq + Clone, V: Clone + PartialEq> PartialEq for SharedMap<K, V> {
    fn eq(&self, other: &Self) -> bool {
        self.0.len() == other.0.len() && self.0.iter().all(|(k, v)| other.0.get(k) == Some(v))
    }
}

impl<K: Hash + Eq + Clone, V: Clone + Eq> Eq for SharedMap<K, V> {}

impl<K: Hash + Eq + Clone, V: Clone> Default for SharedMap<K, V> {
    fn default() -> Self {
        SharedMap(imbl::GenericHashMap::default())
    }
}

impl<K: Hash + Eq + Clone, V: Clone> Deref for SharedMap<K, V> {
    type Target = imbl::GenericHashMap<K, V, Keyed, Shared>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl<K: Hash + Eq + Clone, V: Clone> DerefMut for SharedMap<K, V> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl<K: Hash + Eq + Ord + Clone, V: Clone> SharedMap<K, V> {
    /// The entries in key order.
    pub fn sorted(&self) -> Vec<(&K, &V)> {
        sorted(self.0.iter())
    }
}

impl<K: Hash + Eq + Ord + Clone + Serialize, V: Clone + Serialize> Serialize for SharedMap<K, V> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.sorted())
    }
}

impl<'de, K, V> Deserialize<'de> for SharedMap<K, V>
where
    K: Hash + Eq + Clone + Deserialize<'de>,
    V: Clone + Deserialize<'de>,
{
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut map = SharedMap::default();
        decode_entries(d, &mut map.0, |m, k, v| m.insert(k, v).is_some())?;
        Ok(map)
    }
}

impl<K: Hash + Eq + Clone, V: Clone> FromIterator<(K, V)> for SharedMap<K, V> {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        SharedMap(iter.into_iter().collect())
    }
}

/// A persistent FIFO (imbl's RRB vector): O(1) clone, amortised O(1) `push_back` and
/// `pop_front`; encodes as a sequence, exactly like a `VecDeque`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedQueue<T: Clone>(imbl::GenericVector<T, Shared>);

impl<T: Clone> Default for SharedQueue<T> {
    fn default() -> Self {
        SharedQueue(imbl::GenericVector::new())
    }
}

impl<T: Clone> Deref for SharedQueue<T> {
    type Target = imbl::GenericVector<T, Shared>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl<T: Clone> DerefMut for SharedQueue<T> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl<T: Clone + Serialize> Serialize for SharedQueue<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter())
    }
}

impl<'de, T: Clone + Deserialize<'de>> Deserialize<'de> for SharedQueue<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(SharedQueue(Vec::<T>::deserialize(d)?.into_iter().collect()))
    }
}

/// A persistent ordered set (imbl's B-tree): O(1) clone, O(log n) insert, remove and
/// minimum; encodes as its elements in order, exactly like a `BTreeSet`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedSet<T: Ord + Clone>(imbl::GenericOrdSet<T, Shared>);

impl<T: Ord + Clone> Default for SharedSet<T> {
    fn default() -> Self {
        SharedSet(imbl::GenericOrdSet::new())
    }
}

impl<T: Ord + Clone> Deref for SharedSet<T> {
    type Target = imbl::GenericOrdSet<T, Shared>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl<T: Ord + Clone> DerefMut for SharedSet<T> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl<T: Ord + Clone + Serialize> Serialize for SharedSet<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter())
    }
}

impl<'de, T: Ord + Clone + Deserialize<'de>> Deserialize<'de> for SharedSet<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(SharedSet(Vec::<T>::deserialize(d)?.into_iter().collect()))
    }
}

impl<K: Hash + Eq, V> FromIterator<(K, V)> for IdMap<K, V> {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        IdMap(iter.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::hash::Hasher;

    thread_local! {
        /// Key comparisons made by the maps under test: the work a lookup or insert does
        /// beyond hashing (a long collision chain is many comparisons).
        static COMPARISONS: Cell<u64> = const { Cell::new(0) };
    }

    /// A u64 key that hashes like one and counts its comparisons.
    #[derive(Clone, Copy, Debug, PartialOrd, Ord)]
    struct Counted(u64);

    impl PartialEq for Counted {
        fn eq(&self, other: &Self) -> bool {
            COMPARISONS.with(|c| c.set(c.get() + 1));
            self.0 == other.0
        }
    }
    impl Eq for Counted {}
    impl Hash for Counted {
        fn hash<H: Hasher>(&self, h: &mut H) {
            self.0.hash(h)
        }
    }

    /// The hasher the tables used before issue 20 (FxHash-style, seedless):
    /// `hash(id) = id × K`.
    const OLD_K: u64 = 0x517c_c1b7_2722_0a95;

    /// `n` ids whose old hashes are equal in their low 32 bits and top 7 bits — the bits
    /// both hash tables index by: under the old hasher every one lands in the same
    /// bucket and chain. (`id = (j << 32) × K⁻¹`.)
    fn colliding_ids(n: u64) -> Vec<u64> {
        let mut inv = OLD_K;
        for _ in 0..6 {
            inv = inv.wrapping_mul(2u64.wrapping_sub(OLD_K.wrapping_mul(inv)));
        }
        assert_eq!(OLD_K.wrapping_mul(inv), 1);
        (1..=n).map(|j| (j << 32).wrapping_mul(inv)).collect()
    }

    fn comparisons<M: Default>(ids: &[u64], insert: impl Fn(&mut M, Counted), budget: u64) -> u64 {
        COMPARISONS.with(|c| c.set(0));
        let mut m = M::default();
        for (i, &id) in ids.iter().enumerate() {
            insert(&mut m, Counted(id));
            let used = COMPARISONS.with(|c| c.get());
            assert!(
                used <= budget,
                "{used} key comparisons after {i} inserts: the ids collide (budget {budget})"
            );
        }
        COMPARISONS.with(|c| c.get())
    }

    /// Hash flooding (issue 20): 100,000 ids chosen to collide under the old seedless
    /// hasher cost at most twice the key comparisons of 100,000 random ids, in both
    /// kinds of table. (Under the old hasher each insert walked the whole chain: about
    /// 5 × 10⁹ comparisons, which the budget stops at once.)
    #[test]
    fn ids_chosen_to_collide_cost_no_more_than_random_ids() {
        let n = 100_000;
        let bad = colliding_ids(n);
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let random: Vec<u64> = (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            })
            .collect();
        // The ids really collide under the old hasher.
        let old = |id: u64| id.wrapping_mul(OLD_K);
        assert!(bad
            .iter()
            .all(|&id| old(id) as u32 == 0 && old(id) >> 57 == 0));
        let plain = |m: &mut IdMap<Counted, u32>, k| {
            m.insert(k, 1);
        };
        let shared = |m: &mut SharedMap<Counted, u32>, k| {
            m.insert(k, 1);
        };
        let base = comparisons(&random, plain, u64::MAX);
        let flood = comparisons(&bad, plain, 2 * base + 1_000);
        eprintln!("IdMap: {base} comparisons for random ids, {flood} for colliding ids");
        let base = comparisons(&random, shared, u64::MAX);
        let flood = comparisons(&bad, shared, 2 * base + 1_000);
        eprintln!("SharedMap: {base} comparisons for random ids, {flood} for colliding ids");
        // Lookups too.
        let m: IdMap<Counted, u32> = bad.iter().map(|&id| (Counted(id), 1)).collect();
        COMPARISONS.with(|c| c.set(0));
        for &id in &bad {
            assert!(m.contains_key(&Counted(id)));
        }
        let looked = COMPARISONS.with(|c| c.get());
        assert!(looked <= 2 * n, "{looked} comparisons for {n} lookups");
    }

    /// The encoding is canonical: the same contents built in different orders encode
    /// to the same bytes.
    #[test]
    fn encoding_is_independent_of_insertion_order() {
        let a: IdMap<u64, u64> = (0..1_000).map(|i| (i, i * 2)).collect();
        let b: IdMap<u64, u64> = (0..1_000).rev().map(|i| (i, i * 2)).collect();
        assert_eq!(crate::codec::encode(&a), crate::codec::encode(&b));
        let back: IdMap<u64, u64> = crate::codec::decode(&crate::codec::encode(&a)).unwrap();
        assert_eq!(back, a);
    }

    #[test]
    fn duplicate_keys_are_rejected_on_decode() {
        let bytes = crate::codec::encode(&vec![(1u64, 1u64), (1u64, 2u64)]);
        assert!(crate::codec::decode::<IdMap<u64, u64>>(&bytes).is_err());
        assert!(crate::codec::decode::<SharedMap<u64, u64>>(&bytes).is_err());
    }

    /// The shared variants encode byte for byte like `IdMap` and `VecDeque` (so the
    /// snapshot format and state hashes do not depend on which one a table uses), and a
    /// clone is a value: writes to one never show in the other.
    #[test]
    fn shared_variants_encode_like_the_plain_ones_and_clones_are_independent() {
        let plain: IdMap<u64, String> = (0..2_000)
            .map(|i| (i * 7919 % 2_003, i.to_string()))
            .collect();
        let mut shared: SharedMap<u64, String> = (0..2_000)
            .rev()
            .map(|i| (i * 7919 % 2_003, i.to_string()))
            .collect();
        assert_eq!(crate::codec::encode(&plain), crate::codec::encode(&shared));
        let back: SharedMap<u64, String> =
            crate::codec::decode(&crate::codec::encode(&plain)).unwrap();
        assert_eq!(back, shared);

        let deque: std::collections::VecDeque<(u64, u32)> =
            (0..5_000).map(|i| (i, i as u32 * 3)).collect();
        let mut queue = SharedQueue::default();
        for &x in &deque {
            queue.push_back(x);
        }
        assert_eq!(crate::codec::encode(&deque), crate::codec::encode(&queue));
        let back: SharedQueue<(u64, u32)> =
            crate::codec::decode(&crate::codec::encode(&deque)).unwrap();
        assert_eq!(back, queue);

        let (map_before, queue_before) = (shared.clone(), queue.clone());
        let bytes_before = (
            crate::codec::encode(&map_before),
            crate::codec::encode(&queue_before),
        );
        shared.insert(5_000, "new".into());
        shared.remove(&0);
        if let Some(v) = shared.get_mut(&1) {
            v.push('!');
        }
        queue.pop_front();
        queue.push_back((9, 9));
        assert_eq!(bytes_before.0, crate::codec::encode(&map_before));
        assert_eq!(bytes_before.1, crate::codec::encode(&queue_before));
        assert_ne!(
            crate::codec::encode(&map_before),
            crate::codec::encode(&shared)
        );
        assert_ne!(
            crate::codec::encode(&queue_before),
            crate::codec::encode(&queue)
        );
    }
}
