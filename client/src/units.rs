//! Human units at the edge: credits with up to six decimals (exactly, no floats) and
//! durations such as `90s`, `30m`, `2h`, `7d`.

use crate::error::{Error, Result};

pub use allot_statemachine::units::{credits as format_credits, MICRO_PER_CREDIT};

/// Parses an amount of credits (`12`, `12.5`, `0.000001`) into micro-credits exactly.
/// More than six decimals, signs, exponents or overflow are errors.
pub fn parse_credits(s: &str) -> Result<u64> {
    let bad = |why: &str| Error::InvalidArgument(format!("amount {s:?}: {why}"));
    let (whole, frac) = match s.split_once('.') {
        Some((w, f)) => (w, f),
        None => (s, ""),
    };
    if whole.is_empty() && frac.is_empty() {
        return Err(bad("empty"));
    }
    let digits = |t: &str| t.bytes().all(|b| b.is_ascii_digit());
    if !digits(whole) || !digits(frac) || (s.contains('.') && frac.is_empty()) {
        return Err(bad(
            "expected digits with an optional decimal point, e.g. 12.5",
        ));
    }
    if frac.len() > 6 {
        return Err(bad("at most 6 decimals (1 micro-credit)"));
    }
    let whole: u64 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| bad("too large"))?
    };
    let frac_micro: u64 = format!("{frac:0<6}")
        .parse()
        .map_err(|_| bad("bad decimals"))?;
    whole
        .checked_mul(MICRO_PER_CREDIT)
        .and_then(|w| w.checked_add(frac_micro))
        .ok_or_else(|| bad("too large"))
}

/// Parses `1500ms`, `90s`, `30m`, `2h`, `7d` (a bare number is seconds) into ms.
pub fn parse_duration_ms(s: &str) -> Result<u64> {
    let bad = || Error::InvalidArgument(format!("duration {s:?}: expected e.g. 90s, 30m, 2h, 7d"));
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num.parse().map_err(|_| bad())?;
    let scale = match unit {
        "ms" => 1,
        "" | "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(bad()),
    };
    n.checked_mul(scale).ok_or_else(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credits_parse_exactly_or_refuse() {
        let ok = [
            ("0", 0),
            ("1", 1_000_000),
            ("12.5", 12_500_000),
            ("0.000001", 1),
            (".5", 500_000),
            ("18446744073709.551615", u64::MAX),
        ];
        for (s, want) in ok {
            assert_eq!(parse_credits(s).unwrap(), want, "{s}");
        }
        for s in [
            "",
            ".",
            "1.",
            "-1",
            "+1",
            "1e6",
            "0.0000001",
            "1.2.3",
            " 1",
            "abc",
            "18446744073709.551616",
        ] {
            assert!(parse_credits(s).is_err(), "{s:?} must be refused");
        }
        assert_eq!(format_credits(12_500_000), "12.500000");
        assert_eq!(format_credits(1), "0.000001");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration_ms("1500ms").unwrap(), 1_500);
        assert_eq!(parse_duration_ms("90").unwrap(), 90_000);
        assert_eq!(parse_duration_ms("30m").unwrap(), 1_800_000);
        assert_eq!(parse_duration_ms("2h").unwrap(), 7_200_000);
        assert_eq!(parse_duration_ms("7d").unwrap(), 604_800_000);
        for s in ["", "h", "2x", "-1s", "1.5h", "99999999999999999999d"] {
            assert!(parse_duration_ms(s).is_err(), "{s:?}");
        }
    }
}
