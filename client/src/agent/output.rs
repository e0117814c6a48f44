//! A runner's output, capped: its stdout and stderr go through a pipe to a thread that
//! writes them to the attempt's log up to `--log-max` bytes, then keeps only the last
//! [`TAIL`] bytes (where a failure's message usually is), and at the end writes a line
//! saying how much it dropped, then that tail. The runner never blocks on a full disk
//! or a slow log: past the cap, and when a write fails, its output is read and dropped.
//!
//! A log is therefore at most `log_max + TAIL + ` one line, however much a job prints;
//! [`super::prune_logs`] deletes logs past their retention.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};

/// The end of a capped log that is kept, besides its first `log_max` bytes.
pub const TAIL: usize = 64 * 1024;

/// A pipe (both ends close-on-exec; the child's copies are dup2'd, which clears it).
pub fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe2 writes two descriptors into `fds`, which we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Copies `from` to `log` until every writer has closed the pipe, capped as the module
/// says. Runs on a thread of its own (blocking reads and writes); returns how many
/// bytes it dropped.
pub fn pump(from: impl Read, log: impl Write, log_max: u64) -> u64 {
    Pump::new(log, log_max).run(from)
}

struct Pump<W: Write> {
    log: W,
    /// Room left before the cap.
    room: u64,
    /// The last bytes past the cap (at most `TAIL`).
    tail: VecDeque<u8>,
    dropped: u64,
    /// A write failed: the rest is read and dropped.
    broken: bool,
}

impl<W: Write> Pump<W> {
    fn new(log: W, log_max: u64) -> Pump<W> {
        Pump {
            log,
            room: log_max,
            tail: VecDeque::new(),
            dropped: 0,
            broken: false,
        }
    }

    fn run(mut self, mut from: impl Read) -> u64 {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => self.take(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        self.finish()
    }

    fn take(&mut self, mut chunk: &[u8]) {
        let head = chunk
            .len()
            .min(usize::try_from(self.room).unwrap_or(usize::MAX));
        if head > 0 {
            if !self.broken && self.log.write_all(&chunk[..head]).is_err() {
                self.broken = true;
            }
            self.room -= head as u64;
            chunk = &chunk[head..];
        }
        if chunk.is_empty() {
            return;
        }
        // Past the cap: keep the last TAIL bytes, count what falls out.
        let keep = &chunk[chunk.len().saturating_sub(TAIL)..];
        self.dropped += (chunk.len() - keep.len()) as u64;
        let over = (self.tail.len() + keep.len()).saturating_sub(TAIL);
        self.dropped += over as u64;
        self.tail.drain(..over);
        self.tail.extend(keep);
    }

    fn finish(mut self) -> u64 {
        if self.dropped > 0 && !self.broken {
            let _ = write!(
                self.log,
                "\n[allot-agent: {} bytes of output dropped here: the log keeps its first bytes up to --log-max and its last {} bytes]\n",
                self.dropped,
                self.tail.len()
            );
        }
        if !self.broken {
            let (a, b) = self.tail.as_slices();
            let _ = self.log.write_all(a).and_then(|()| self.log.write_all(b));
            let _ = self.log.flush();
        }
        self.dropped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Output within the cap is copied as is; past it, the head and the last TAIL bytes
    /// are kept with a line counting what was dropped between them.
    #[test]
    fn a_log_keeps_its_head_and_tail_within_the_cap() {
        let mut log = Vec::new();
        assert_eq!(pump(&b"short output\n"[..], &mut log, 100), 0);
        assert_eq!(log, b"short output\n");

        let total = 10 * TAIL + 123;
        let out: Vec<u8> = (0..total).map(|i| (i % 251) as u8).collect();
        let mut log = Vec::new();
        // Read in uneven pieces, as a pipe delivers them.
        struct Pieces<'a>(&'a [u8], usize);
        impl Read for Pieces<'_> {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                self.1 = self.1 % 7 + 1;
                let n = (self.1 * 9_973).min(buf.len()).min(self.0.len());
                buf[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        let cap = 1_000;
        let dropped = pump(Pieces(&out, 0), &mut log, cap);
        assert_eq!(dropped, (total - cap as usize - TAIL) as u64);
        assert_eq!(&log[..cap as usize], &out[..cap as usize]);
        assert_eq!(&log[log.len() - TAIL..], &out[total - TAIL..]);
        let middle = String::from_utf8_lossy(&log[cap as usize..log.len() - TAIL]);
        assert!(
            middle.contains(&format!("{dropped} bytes of output dropped")),
            "{middle}"
        );
        assert!(log.len() < cap as usize + TAIL + 200);
    }

    /// A log that cannot be written (a full disk) does not stop the reading: the
    /// runner is never blocked by its own output.
    #[test]
    fn a_failing_log_still_drains_the_pipe() {
        struct Full;
        impl Write for Full {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::Error::other("no space left on device"))
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let out = vec![b'x'; 300_000];
        let mut src = &out[..];
        pump(&mut src, Full, 1_000);
        assert!(src.is_empty(), "everything was read");
    }
}
