//! A latency histogram with bounded relative error: exact below 128 µs, then 64
//! sub-buckets per power of two (each bucket's width ≤ 1/64 of its lower bound), so a
//! long run keeps a few kilobytes per client instead of every sample.

use std::time::Duration;

const LINEAR: u64 = 128;
const SUB_BITS: u32 = 6;
const SUB: u64 = 1 << SUB_BITS;
/// Values up to 2^40 µs (≈ 12.7 days) have their own bucket; beyond, the last one.
const MAX_EXP: u32 = 40;
const BUCKETS: usize = LINEAR as usize + (MAX_EXP as usize - 7 + 1) * SUB as usize;

#[derive(Clone)]
pub struct Hist {
    counts: Vec<u64>,
    total: u64,
    max_us: u64,
}

impl Default for Hist {
    fn default() -> Self {
        Hist {
            counts: vec![0; BUCKETS],
            total: 0,
            max_us: 0,
        }
    }
}

fn index(us: u64) -> usize {
    if us < LINEAR {
        return us as usize;
    }
    let exp = (63 - us.leading_zeros()).min(MAX_EXP);
    let sub = (us.min((1 << (MAX_EXP + 1)) - 1) >> (exp - SUB_BITS)) & (SUB - 1);
    LINEAR as usize + (exp as usize - 7) * SUB as usize + sub as usize
}

/// The largest value (µs) bucket `i` holds.
fn upper(i: usize) -> u64 {
    if i < LINEAR as usize {
        return i as u64;
    }
    let j = i - LINEAR as usize;
    let exp = (j / SUB as usize) as u32 + 7;
    let sub = (j % SUB as usize) as u64;
    let width = 1u64 << (exp - SUB_BITS);
    (1u64 << exp) + (sub + 1) * width - 1
}

impl Hist {
    pub fn record(&mut self, d: Duration) {
        let us = d.as_micros().min(u64::MAX as u128) as u64;
        self.counts[index(us)] += 1;
        self.total += 1;
        self.max_us = self.max_us.max(us);
    }

    pub fn merge(&mut self, other: &Hist) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
        self.max_us = self.max_us.max(other.max_us);
    }

    #[cfg(test)]
    pub fn count(&self) -> u64 {
        self.total
    }

    /// Quantile `q` in ms: the upper bound of its bucket (within 1/64 above the value),
    /// never above the largest value seen; 0 when empty.
    pub fn quantile_ms(&self, q: f64) -> f64 {
        if self.total == 0 {
            return 0.0;
        }
        let rank = ((self.total as f64 * q).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return upper(i).min(self.max_us) as f64 / 1e3;
            }
        }
        self.max_us as f64 / 1e3
    }

    pub fn max_ms(&self) -> f64 {
        self.max_us as f64 / 1e3
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_value_in_order_within_a_sixty_fourth() {
        let mut prev_upper = None;
        for i in 0..BUCKETS {
            let u = upper(i);
            if let Some(p) = prev_upper {
                assert!(u > p, "bucket {i}");
                assert_eq!(index(p + 1), i, "value {} lands in bucket {i}", p + 1);
            }
            assert_eq!(index(u), i, "upper bound of {i}");
            prev_upper = Some(u);
        }
        for us in [128u64, 1000, 12_345, 1 << 20, 999_999_999] {
            let u = upper(index(us));
            assert!(u >= us && (u - us) as f64 <= us as f64 / 64.0, "{us} → {u}");
        }
    }

    #[test]
    fn quantiles_of_a_known_sample() {
        let mut h = Hist::default();
        for us in 1..=1000u64 {
            h.record(Duration::from_micros(us * 10));
        }
        assert_eq!(h.count(), 1000);
        let p50 = h.quantile_ms(0.5);
        assert!((5.0..=5.0 * (1.0 + 1.0 / 64.0)).contains(&p50), "{p50}");
        let p99 = h.quantile_ms(0.99);
        assert!((9.9..=9.9 * (1.0 + 1.0 / 64.0)).contains(&p99), "{p99}");
        assert_eq!(h.quantile_ms(1.0), 10.0);
        assert_eq!(h.max_ms(), 10.0);
        let mut merged = Hist::default();
        merged.merge(&h);
        merged.merge(&h);
        assert_eq!(merged.count(), 2000);
        assert_eq!(merged.quantile_ms(0.5), p50);
        assert_eq!(Hist::default().quantile_ms(0.99), 0.0);
    }
}
