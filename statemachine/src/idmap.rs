//! `IdMap`: the state's point-lookup tables. A hash map (fewer cache misses than a
//! B-tree on the hot path) with a fixed, seedless hasher, whose encoding is the entries
//! *sorted by key* — so snapshots and `state_hash` stay canonical however the map was
//! built (log replay or snapshot restore).
//!
//! [`SharedMap`] and [`SharedQueue`] are the persistent (structurally shared) variants
//! for the tables that grow with traffic history — the idempotency table and its
//! pruning queue: cloning them is O(1), so a snapshot can take a consistent copy of the
//! state without holding apply back for a copy of every record. They encode exactly like
//! `IdMap` and `VecDeque`, so the choice does not show in snapshots or state hashes.
//!
//! Invariant: apply never depends on an `IdMap`'s iteration order. Anything that must
//! be visited in order keeps its own ordered index (spend lists, the expiry queue, the
//! settled and idempotency queues). Order-insensitive reads (sums in invariant checks)
//! may iterate; [`IdMap::sorted`] gives a canonical order where one is needed.

use serde::de::{Deserialize, Deserializer};
use serde::ser::{Serialize, Serializer};
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::ops::{Deref, DerefMut};

/// FxHash-style multiplicative hasher: fast for integer ids, identical on every replica.
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

const K: u64 = 0x517c_c1b7_2722_0a95;

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(b));
        }
    }
    fn write_u8(&mut self, i: u8) {
        self.write_u64(i as u64);
    }
    fn write_u32(&mut self, i: u32) {
        self.write_u64(i as u64);
    }
    fn write_u64(&mut self, i: u64) {
        self.0 = (self.0.rotate_left(5) ^ i).wrapping_mul(K);
    }
    fn write_u128(&mut self, i: u128) {
        self.write_u64(i as u64);
        self.write_u64((i >> 64) as u64);
    }
    fn write_usize(&mut self, i: usize) {
        self.write_u64(i as u64);
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdMap<K: Hash + Eq, V>(HashMap<K, V, BuildHasherDefault<IdHasher>>);

impl<K: Hash + Eq, V> Default for IdMap<K, V> {
    fn default() -> Self {
        IdMap(HashMap::default())
    }
}

impl<K: Hash + Eq, V> Deref for IdMap<K, V> {
    type Target = HashMap<K, V, BuildHasherDefault<IdHasher>>;
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

/// A persistent hash map with [`IdMap`]'s hasher and encoding: a clone shares every node
/// with the original (O(1)); a write after a clone copies only the path to the entry it
/// changes. Lookups cost about twice an `IdMap`'s, so it is used only where a table
/// grows with history and is mostly written once (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedMap<K: Hash + Eq + Clone, V: Clone>(
    imbl::GenericHashMap<K, V, BuildHasherDefault<IdHasher>, Shared>,
);

impl<K: Hash + Eq + Clone, V: Clone> Default for SharedMap<K, V> {
    fn default() -> Self {
        SharedMap(imbl::GenericHashMap::default())
    }
}

impl<K: Hash + Eq + Clone, V: Clone> Deref for SharedMap<K, V> {
    type Target = imbl::GenericHashMap<K, V, BuildHasherDefault<IdHasher>, Shared>;
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

impl<K: Hash + Eq, V> FromIterator<(K, V)> for IdMap<K, V> {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        IdMap(iter.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
