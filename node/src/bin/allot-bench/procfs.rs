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

/// Whether process `pid` is still running: it exists and is not a zombie (a child that
/// exited and has not been reaped yet).
pub fn running(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().next());
    !matches!(state, None | Some("Z" | "X"))
}

/// CPU seconds of each of a set of processes, in order (a missing one counts 0).
pub fn cpu_each(pids: &[u32]) -> Vec<f64> {
    pids.iter()
        .map(|&p| cpu_seconds(p).unwrap_or(0.0))
        .collect()
}

/// What each process used between two readings of [`cpu_each`] (never below 0: a
/// process that is gone at the second reading counts 0 there).
pub fn cpu_between(before: &[f64], after: &[f64]) -> Vec<f64> {
    before
        .iter()
        .zip(after)
        .map(|(b, a)| (a - b).max(0.0))
        .collect()
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
        let each = cpu_each(&[me, u32::MAX]);
        assert_eq!((each.len(), each[1]), (2, 0.0));
        assert!(each[0] >= after);
        assert_eq!(cpu_between(&[1.0, 5.0], &[1.5, 0.0]), vec![0.5, 0.0]);
    }

    #[test]
    fn a_child_that_exited_is_not_running() {
        assert!(running(std::process::id()));
        assert!(!running(u32::MAX));
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let pid = child.id();
        // Not reaped yet: a zombie until `wait`, which is what a dead node looks like to
        // the benchmark that started it.
        while running(pid) {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
        child.wait().expect("reap");
        assert!(!running(pid));
    }
}
