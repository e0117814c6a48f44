//! Decayed GPU usage for fair share: `value × 2^(−Δt / half_life)`, in integer
//! arithmetic (a Q32 table of 2^(−k/16) with linear interpolation between entries), so
//! every replica computes the identical figure.

use serde::{Deserialize, Serialize};

/// 2^(−k/16) in Q32, k = 0..=16.
const POW2_NEG_Q32: [u64; 17] = [
    4_294_967_296,
    4_112_874_773,
    3_938_502_376,
    3_771_522_796,
    3_611_622_603,
    3_458_501_653,
    3_311_872_529,
    3_171_459_999,
    3_037_000_500,
    2_908_241_642,
    2_784_941_738,
    2_666_869_345,
    2_553_802_834,
    2_445_529_972,
    2_341_847_524,
    2_242_560_872,
    2_147_483_648,
];

/// `value × 2^(−elapsed / half_life)`, rounded down.
pub fn decay(value: u64, elapsed_ms: u64, half_life_ms: u64) -> u64 {
    if half_life_ms == 0 || value == 0 {
        return if half_life_ms == 0 { 0 } else { value };
    }
    let halvings = elapsed_ms / half_life_ms;
    if halvings >= 64 {
        return 0;
    }
    let v = value >> halvings;
    // Fraction of a half-life left, in 1/16 steps plus a remainder for interpolation.
    let rem = elapsed_ms % half_life_ms;
    let pos = rem as u128 * 16;
    let k = (pos / half_life_ms as u128) as usize;
    let frac = pos % half_life_ms as u128; // in units of 1/half_life of a step
    let (a, b) = (POW2_NEG_Q32[k] as u128, POW2_NEG_Q32[k + 1] as u128);
    let factor = a - (a - b) * frac / half_life_ms as u128;
    ((v as u128 * factor) >> 32) as u64
}

/// Decayed usage in GPU-milliseconds, as of `at_ms`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecayedUsage {
    pub gpu_ms: u64,
    pub at_ms: u64,
}

impl DecayedUsage {
    pub fn value_at(&self, now: u64, half_life_ms: u64) -> u64 {
        decay(self.gpu_ms, now.saturating_sub(self.at_ms), half_life_ms)
    }

    pub fn add(&mut self, now: u64, half_life_ms: u64, gpu_ms: u64) {
        self.gpu_ms = self.value_at(now, half_life_ms).saturating_add(gpu_ms);
        self.at_ms = now;
    }
}

#[cfg(test)]
mod tests {
    use super::decay;

    #[test]
    fn decay_matches_powers_of_two() {
        let h = 3_600_000;
        let cases = [
            (0, 1_000_000),
            (h, 500_000),
            (2 * h, 250_000),
            (h / 2, 707_106),  // 2^-0.5 = 0.7071067…
            (h / 16, 957_603), // 2^-1/16 = 0.9576032…
            (64 * h, 0),
        ];
        for (elapsed, expected) in cases {
            let got = decay(1_000_000, elapsed, h);
            assert!(
                got.abs_diff(expected) <= 1,
                "decay after {elapsed} ms: {got} != {expected}"
            );
        }
        // Interpolation error between table entries stays below 0.05%.
        let got = decay(1_000_000, h / 32, h);
        let exact = (1_000_000f64 * 2f64.powf(-1.0 / 32.0)) as u64;
        assert!(got.abs_diff(exact) < 500, "{got} vs {exact}");
        // Monotone in elapsed time.
        let mut last = u64::MAX;
        for t in (0..2 * h).step_by(7_919) {
            let v = decay(1_000_000, t, h);
            assert!(v <= last);
            last = v;
        }
    }
}
