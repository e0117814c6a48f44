//! What the benchmark reads of its processes from `/proc`: CPU time (user + system, all
//! threads) and resident memory. Linux only; a process that is gone reads as `None`.

/// CPU seconds (user + system, every thread) process `pid` has used so far.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: fields count from the
    // last ')'. utime and stime are fields 14 and 15, so the 12th and 13th after it.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut f = rest.split_whitespace().skip(11);
    let utime: u64 = f.next()?.parse().ok()?;
    let stime: u64 = f.next()?.parse().ok()?;
    Some((utime + stime) as f64 / ticks_per_second())
}

fn ticks_per_second() -> f64 {
    // SAFETY: sysconf only reads a configuration value.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

/// Resident set size of process `pid` in bytes (`VmRSS`).
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// CPU seconds of a set of processes (missing ones count 0).
pub fn cpu_total(pids: &[u32]) -> f64 {
    pids.iter().filter_map(|&p| cpu_seconds(p)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_readable_and_its_cpu_grows() {
        let me = std::process::id();
        let before = cpu_seconds(me).expect("own stat");
        let t = std::time::Instant::now();
        let mut x = 0u64;
        while t.elapsed() < std::time::Duration::from_millis(300) {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        let after = cpu_seconds(me).expect("own stat");
        assert!(after > before, "{before} → {after}");
        assert!(rss_bytes(me).expect("own status") > 1 << 20);
        assert_eq!(cpu_seconds(u32::MAX), None);
    }
}
