//! `IdMap`: the state's point-lookup tables. A hash map (fewer cache misses than a
//! B-tree on the hot path) with a fixed, seedless hasher, whose encoding is the entries
//! *sorted by key* — so snapshots and `state_hash` stay canonical however the map was
//! built (log replay or snapshot restore).
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
        let mut v: Vec<(&K, &V)> = self.0.iter().collect();
        v.sort_unstable_by(|a, b| a.0.cmp(b.0));
        v
    }
}

impl<K: Hash + Eq + Ord + Serialize, V: Serialize> Serialize for IdMap<K, V> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.sorted())
    }
}

impl<'de, K: Hash + Eq + Deserialize<'de>, V: Deserialize<'de>> Deserialize<'de> for IdMap<K, V> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let entries: Vec<(K, V)> = Vec::deserialize(d)?;
        let mut map = HashMap::with_capacity_and_hasher(entries.len(), Default::default());
        for (k, v) in entries {
            if map.insert(k, v).is_some() {
                return Err(serde::de::Error::custom("duplicate key in map"));
            }
        }
        Ok(IdMap(map))
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
    }
}
