//! Calendar periods of logical time (UTC), for budget periods. Pure integer arithmetic.

const MS_PER_DAY: u64 = 86_400_000;

/// Days since 1970-01-01 of a logical instant.
pub fn day_index(time_ms: u64) -> u32 {
    (time_ms / MS_PER_DAY) as u32
}

/// Months since 1970-01 of a logical instant (UTC calendar months).
pub fn month_index(time_ms: u64) -> u32 {
    let (y, m, _) = civil_from_days(day_index(time_ms) as i64);
    ((y - 1970) * 12 + (m as i64 - 1)) as u32
}

/// (year, month 1..=12, day 1..=31) of a day count since the epoch
/// (H. Hinnant's `civil_from_days`).
pub fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(time_ms: u64, expected: (i64, u32, u32), month: u32) {
        assert_eq!(civil_from_days(day_index(time_ms) as i64), expected);
        assert_eq!(month_index(time_ms), month);
    }

    #[test]
    fn calendar_boundaries() {
        check(0, (1970, 1, 1), 0);
        check(31 * MS_PER_DAY - 1, (1970, 1, 31), 0);
        check(31 * MS_PER_DAY, (1970, 2, 1), 1);
        // 2024-02-29 (leap day) = day 19782; 2024-03-01 = 19783.
        check(19_782 * MS_PER_DAY, (2024, 2, 29), 54 * 12 + 1);
        check(19_783 * MS_PER_DAY, (2024, 3, 1), 54 * 12 + 2);
        // 2026-11-21 = day 20778.
        check(20_778 * MS_PER_DAY + 5, (2026, 11, 21), 56 * 12 + 10);
    }
}
