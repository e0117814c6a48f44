//! One cgroup (v2) per attempt: everything a runner starts stays countable and killable.
//!
//! A process group is not a container: a runner's child that calls `setsid()` leaves it,
//! and the kernel's parent-death signal reaches the runner alone. Such a process would
//! hold the attempt's GPUs and go on working after the cluster moved the job elsewhere.
//! A cgroup cannot be left by an unprivileged process, and `cgroup.kill` (Linux 5.14)
//! SIGKILLs every process in it at once, forks racing the kill included.
//!
//! The agent keeps its attempts' cgroups under one directory of its own (the *base*,
//! `allot-runners-<hash of the work dir>`), so a restarted agent with the same work dir
//! finds the cgroups its predecessor left and empties them before it registers. The
//! base's parent is the agent's own cgroup with `--cgroup auto` (the default), or the
//! directory `--cgroup DIR` names; `--cgroup off` runs without (process groups only).
//! Only directories named as this module names them are ever touched under the base.
//! `auto` falls back to off, with a warning, where cgroup v2 is not writable (no
//! cgroup2 mount, an unprivileged agent without a delegated subtree, a kernel without
//! `cgroup.kill`) — unless a predecessor's cgroups are still there, which it could not
//! empty: then it does not start. A named directory that does not work is a start-up
//! error. Under systemd, give the unit `Delegate=yes` (docs/allot-agent.service).
//!
//! Containment holds against job code that is not the agent's user (`--runner-user`):
//! a process of the agent's own user could move itself to another cgroup it may write.
//! Other ways a runner user can start processes later (cron, at, systemd user units)
//! are the host's to close (deny them to the runner user).
//!
//! No controller is enabled: the cgroups only contain, they do not limit. The runner
//! joins its cgroup between fork and exec, before it drops to the runner user.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::time::Instant;
use tracing::{error, warn};

/// Where the agent puts its attempts' cgroups (`--cgroup`).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum CgroupMode {
    /// A child of the agent's own cgroup if cgroup v2 is usable there, else none.
    #[default]
    Auto,
    /// No cgroups: runners are contained by their process group only.
    Off,
    /// This directory (in a cgroup v2 hierarchy), which must be usable.
    At(PathBuf),
}

impl std::str::FromStr for CgroupMode {
    type Err = String;

    fn from_str(s: &str) -> Result<CgroupMode, String> {
        match s {
            "auto" => Ok(CgroupMode::Auto),
            "off" => Ok(CgroupMode::Off),
            p if p.starts_with('/') => Ok(CgroupMode::At(PathBuf::from(p))),
            _ => Err("expected auto, off or an absolute cgroup directory".into()),
        }
    }
}

/// The agent's directory of attempt cgroups.
#[derive(Debug)]
pub struct Cgroups {
    base: PathBuf,
}

/// How long a killed cgroup may take to empty before the agent says so (and kills it
/// again).
const EMPTY_TIMEOUT: Duration = Duration::from_secs(10);
/// Name prefixes of the cgroups this module makes under its base.
const ATTEMPT: &str = "a";
const PROBE: &str = "probe-";

/// Whether `name` is one of this module's cgroups: `a<n>-<n>-<n>-<n>` or `probe-<n>`.
fn ours(name: &str) -> bool {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    match (name.strip_prefix(PROBE), name.strip_prefix(ATTEMPT)) {
        (Some(pid), _) => digits(pid),
        (None, Some(rest)) => {
            let parts: Vec<&str> = rest.split('-').collect();
            parts.len() == 4 && parts.iter().all(|p| digits(p))
        }
        _ => false,
    }
}

impl Cgroups {
    /// Opens (creating it) the base directory `mode` names for the agent whose work dir
    /// is `work_dir`, and proves it works by running a short process in a cgroup under
    /// it. `Ok(None)`: run without cgroups.
    pub fn open(mode: &CgroupMode, work_dir: &Path) -> Result<Option<Cgroups>, String> {
        let parent = match mode {
            CgroupMode::Off => return Ok(None),
            CgroupMode::At(p) => p.clone(),
            CgroupMode::Auto => match own_cgroup_dir() {
                Some(own) => own,
                None => {
                    warn!("no cgroup v2 hierarchy: runners are contained by their process group only (a runner's child that calls setsid() escapes the agent's kills)");
                    return Ok(None);
                }
            },
        };
        let cg = Cgroups {
            base: parent.join(format!(
                "allot-runners-{:016x}",
                fnv1a(work_dir.as_os_str().as_encoded_bytes())
            )),
        };
        match cg.probe() {
            Ok(()) => Ok(Some(cg)),
            // A predecessor's cgroups that cannot be emptied: its processes may hold the
            // GPUs this node would offer.
            Err(e) if !cg.children().is_empty() => Err(format!(
                "{}: a previous agent process's cgroups are there, and cgroup v2 does not work for this one ({e})",
                cg.base.display()
            )),
            Err(e) if *mode == CgroupMode::Auto => {
                warn!(base = %cg.base.display(), "cgroup v2 is not usable here ({e}): runners are contained by their process group only (a runner's child that calls setsid() escapes the agent's kills, and keeps its log open); run the agent as root or with a delegated cgroup (systemd Delegate=yes)");
                let _ = std::fs::remove_dir(&cg.base);
                Ok(None)
            }
            Err(e) => Err(format!("--cgroup {}: {e}", parent.display())),
        }
    }

    /// Creates the base and runs `/bin/sh -c 'exit 0'` in a cgroup under it.
    fn probe(&self) -> Result<(), String> {
        std::fs::create_dir_all(&self.base).map_err(|e| e.to_string())?;
        if !self.base.join("cgroup.kill").exists() {
            return Err("not a cgroup v2 directory, or the kernel has no cgroup.kill (Linux 5.14 or later is needed)".into());
        }
        let probe = self
            .create(&format!("{PROBE}{}", std::process::id()))
            .map_err(|e| e.to_string())?;
        let procs = probe.procs_path();
        let mut cmd = std::process::Command::new("/bin/sh");
        cmd.args(["-c", "exit 0"]);
        // SAFETY: `join` only opens, writes and closes a file (async-signal-safe).
        unsafe {
            use std::os::unix::process::CommandExt;
            cmd.pre_exec(move || join(&procs));
        }
        let r = cmd.status();
        let _ = std::fs::remove_dir(&probe.dir);
        match r {
            Ok(st) if st.success() => Ok(()),
            Ok(st) => Err(format!("a probe process in a cgroup ended {st}")),
            Err(e) => Err(format!("cannot start a process in a cgroup: {e}")),
        }
    }

    /// Creates the cgroup `name` under the base (and the base, if it went missing).
    fn create(&self, name: &str) -> std::io::Result<Attempt> {
        let dir = self.base.join(name);
        std::fs::create_dir_all(&self.base)?;
        std::fs::create_dir(&dir)?;
        Ok(Attempt { dir })
    }

    /// Creates the cgroup of an attempt: named by the agent process's incarnation too,
    /// as a restarted agent may run the same attempt again and never reuses a
    /// predecessor's cgroup.
    pub fn create_attempt(
        &self,
        incarnation: u64,
        org: u64,
        job: u64,
        attempt: u32,
    ) -> std::io::Result<Attempt> {
        self.create(&format!("{ATTEMPT}{incarnation}-{org}-{job}-{attempt}"))
    }

    /// The cgroups this module made under the base (a previous agent process's, at
    /// start); anything else there is left alone.
    pub fn children(&self) -> Vec<Attempt> {
        let Ok(entries) = std::fs::read_dir(&self.base) else {
            return Vec::new();
        };
        let mut out: Vec<Attempt> = entries
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .filter(|e| ours(&e.file_name().to_string_lossy()))
            .map(|e| Attempt { dir: e.path() })
            .collect();
        out.sort_by(|a, b| a.dir.cmp(&b.dir));
        out
    }

    /// Removes the base if it is empty (a clean shutdown).
    pub fn close(&self) {
        let _ = std::fs::remove_dir(&self.base);
    }
}

/// One attempt's cgroup.
#[derive(Debug)]
pub struct Attempt {
    dir: PathBuf,
}

impl Attempt {
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The path of `cgroup.procs`, ready for [`join`] between fork and exec.
    pub fn procs_path(&self) -> CString {
        use std::os::unix::ffi::OsStrExt;
        // A path built from a directory we created has no NUL byte.
        CString::new(self.dir.join("cgroup.procs").as_os_str().as_bytes()).unwrap_or_default()
    }

    /// Whether any process is still in the cgroup (`cgroup.events`: `populated 1`).
    /// A cgroup that cannot be read counts as empty only when it is gone.
    pub fn populated(&self) -> bool {
        match std::fs::read_to_string(self.dir.join("cgroup.events")) {
            Ok(s) => s.lines().any(|l| l.trim() == "populated 1"),
            Err(e) => e.kind() != std::io::ErrorKind::NotFound,
        }
    }

    /// Sends `sig` to every process in the cgroup outside the process groups `skip`
    /// (which the caller signals as groups: a process must not get SIGTERM twice, as
    /// many runners take a second one as "quit now"). The cgroup is frozen meanwhile, so
    /// no pid read here can exit and be reused by another process before its signal;
    /// the signals arrive when it thaws.
    pub async fn signal(&self, sig: libc::c_int, skip: &[u32]) {
        let freeze = self.dir.join("cgroup.freeze");
        let froze = std::fs::write(&freeze, "1").is_ok();
        if froze {
            // Frozen once `cgroup.events` says so (bounded: a freeze that does not
            // finish only leaves the read racing exits, as without one).
            let until = Instant::now() + Duration::from_secs(1);
            while Instant::now() < until
                && !std::fs::read_to_string(self.dir.join("cgroup.events"))
                    .unwrap_or_default()
                    .lines()
                    .any(|l| l.trim() == "frozen 1")
            {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        if let Ok(s) = std::fs::read_to_string(self.dir.join("cgroup.procs")) {
            for pid in s
                .lines()
                .filter_map(|l| l.trim().parse::<libc::pid_t>().ok())
            {
                // SAFETY: getpgid and kill(2) on a pid; no memory is shared.
                let pgid = unsafe { libc::getpgid(pid) };
                if pid > 1 && !(pgid > 0 && skip.contains(&(pgid as u32))) {
                    unsafe { libc::kill(pid, sig) };
                }
            }
        }
        if froze {
            if let Err(e) = std::fs::write(&freeze, "0") {
                error!(cgroup = %self.dir.display(), "cannot thaw the attempt's cgroup: {e}");
            }
        }
    }

    /// SIGKILLs every process in the cgroup at once (`cgroup.kill`).
    pub fn kill(&self) {
        if let Err(e) = std::fs::write(self.dir.join("cgroup.kill"), "1") {
            if e.kind() != std::io::ErrorKind::NotFound {
                error!(cgroup = %self.dir.display(), "cannot kill the attempt's cgroup: {e}");
            }
        }
    }

    /// Kills everything in the cgroup, waits until it is empty, and removes it. A
    /// process that does not die (stuck in the kernel: a hung driver) is killed again
    /// every [`EMPTY_TIMEOUT`], with an error each time, for as long as it takes: the
    /// attempt does not end while anything of it is alive.
    pub async fn kill_and_remove(&self) {
        self.kill();
        let mut until = Instant::now() + EMPTY_TIMEOUT;
        while self.populated() {
            if Instant::now() >= until {
                error!(cgroup = %self.dir.display(), "the attempt's cgroup is not empty {EMPTY_TIMEOUT:?} after cgroup.kill: killing again (the attempt is not over until it is)");
                self.kill();
                until = Instant::now() + EMPTY_TIMEOUT;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        match std::fs::remove_dir(&self.dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                warn!(cgroup = %self.dir.display(), "cannot remove the attempt's cgroup: {e}")
            }
        }
    }
}

/// Moves the calling process into the cgroup whose `cgroup.procs` is `procs` (writing
/// `0` names the writer). Async-signal-safe: for use between fork and exec.
pub fn join(procs: &CStr) -> std::io::Result<()> {
    // SAFETY: open/write/close on a NUL-terminated path and a static buffer.
    unsafe {
        let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let n = libc::write(fd, b"0".as_ptr().cast(), 1);
        let err = std::io::Error::last_os_error();
        libc::close(fd);
        if n != 1 {
            return Err(err);
        }
    }
    Ok(())
}

/// The agent's own cgroup directory in the cgroup v2 hierarchy, if there is one.
fn own_cgroup_dir() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    own_cgroup_dir_from(&mounts, &cgroups)
}

/// [`own_cgroup_dir`] from the text of `/proc/self/mountinfo` and `/proc/self/cgroup`.
fn own_cgroup_dir_from(mountinfo: &str, cgroup: &str) -> Option<PathBuf> {
    // The v2 line of /proc/self/cgroup is `0::<path>`.
    let own = Path::new(cgroup.lines().find_map(|l| l.strip_prefix("0::"))?.trim());
    if own
        .components()
        .any(|c| c == std::path::Component::ParentDir)
    {
        return None;
    }
    // mountinfo: `id parent maj:min root mountpoint options [optional...] - fstype ...`.
    // The cgroup path is relative to the namespace's root; each cgroup2 mount shows
    // `root` of it: the one whose root is the longest prefix of our path is ours.
    mountinfo
        .lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            if right.split_whitespace().next()? != "cgroup2" {
                return None;
            }
            let mut f = left.split_whitespace();
            let root = PathBuf::from(unescape(f.nth(3)?));
            let mountpoint = PathBuf::from(unescape(f.next()?));
            let rel = own.strip_prefix(&root).ok()?.to_path_buf();
            Some((root.components().count(), mountpoint.join(rel)))
        })
        .max_by_key(|(depth, _)| *depth)
        .map(|(_, dir)| dir)
}

/// Undoes mountinfo's octal escapes (`\040` for a space).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// FNV-1a (64-bit): a hash that stays the same across releases, for naming the base.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The agent's cgroup is found in a pure v2 system, a hybrid one (v2 at
    /// `/sys/fs/cgroup/unified`) and inside a cgroup namespace; none without a v2 mount.
    #[test]
    fn the_agents_own_cgroup_is_found_from_proc() {
        let pure = "30 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw\n";
        let hybrid = "25 24 0:22 / /sys/fs/cgroup ro - tmpfs tmpfs ro\n\
                      26 25 0:23 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n\
                      33 25 0:30 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n";
        let service = "4:memory:/system.slice/a.service\n0::/system.slice/allot-agent.service\n";
        assert_eq!(
            own_cgroup_dir_from(pure, service),
            Some(PathBuf::from(
                "/sys/fs/cgroup/system.slice/allot-agent.service"
            ))
        );
        assert_eq!(
            own_cgroup_dir_from(hybrid, "0::/\n"),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        // A namespace whose mount shows a sub-tree: the path is relative to it.
        let ns = "30 23 0:26 /kubepods /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            own_cgroup_dir_from(ns, "0::/kubepods/pod1\n"),
            Some(PathBuf::from("/sys/fs/cgroup/pod1"))
        );
        assert_eq!(own_cgroup_dir_from(ns, "0::/elsewhere\n"), None);
        // Of two v2 mounts, the one whose root holds our cgroup.
        let two = "30 23 0:26 /other /mnt/a rw - cgroup2 cgroup2 rw\n\
                   31 23 0:26 /kubepods /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        assert_eq!(
            own_cgroup_dir_from(two, "0::/kubepods/pod1\n"),
            Some(PathBuf::from("/sys/fs/cgroup/pod1"))
        );
        assert_eq!(
            own_cgroup_dir_from(hybrid.lines().next().unwrap(), "0::/\n"),
            None
        );
        assert_eq!(own_cgroup_dir_from(pure, "1:name=systemd:/\n"), None);
        assert_eq!(unescape("/a\\040b"), "/a b");
    }

    /// Only the cgroups this module names are ever touched under its base.
    #[test]
    fn only_its_own_cgroups_are_taken_for_orphans() {
        for name in ["a1-2-3-4", "a1795756409560-1-602-1", "probe-17"] {
            assert!(ours(name), "{name}");
        }
        for name in [
            "allot-agent.service",
            "a1-2-3",
            "a1-2-3-4-5",
            "a-1-2-3",
            "probe-",
            "ax-1-2-3",
            "user.slice",
        ] {
            assert!(!ours(name), "{name}");
        }
    }

    #[test]
    fn modes_parse() {
        assert_eq!("auto".parse(), Ok(CgroupMode::Auto));
        assert_eq!("off".parse(), Ok(CgroupMode::Off));
        assert_eq!(
            "/sys/fs/cgroup/x".parse(),
            Ok(CgroupMode::At(PathBuf::from("/sys/fs/cgroup/x")))
        );
        assert!("x".parse::<CgroupMode>().is_err());
        // The base's name depends on the work dir and on nothing else.
        assert_eq!(
            fnv1a(b"/var/lib/allot-agent"),
            fnv1a(b"/var/lib/allot-agent")
        );
        assert_ne!(fnv1a(b"/var/lib/a"), fnv1a(b"/var/lib/b"));
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
    }
}
