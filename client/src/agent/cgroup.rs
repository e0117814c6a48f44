//! One cgroup (v2) per attempt: everything a runner starts stays countable and killable.
//!
//! A process group is not a container: a runner's child that calls `setsid()` leaves it,
//! and the kernel's parent-death signal reaches the runner alone. Such a process would
//! hold the attempt's GPUs and go on working after the cluster moved the job elsewhere.
//! A cgroup cannot be left by an unprivileged process, and `cgroup.kill` (Linux 5.14)
//! SIGKILLs every process in it at once, forks racing the kill included.
//!
//! The agent keeps its attempts' cgroups under one directory of its own (the *base*):
//! `--cgroup auto` (the default) makes it a child of the agent's own cgroup, named from
//! the work dir (`allot-runners-<hash>`), so a restarted agent with the same work dir
//! finds the cgroups its predecessor left and empties them before it registers;
//! `--cgroup DIR` names it; `--cgroup off` runs without (process groups only). `auto`
//! falls back to off, with a warning, where cgroup v2 is not writable (no cgroup2
//! mount, an unprivileged agent without a delegated subtree, a kernel without
//! `cgroup.kill`); a named directory that does not work is a start-up error. Under
//! systemd, give the unit `Delegate=yes` (docs/allot-agent.service).
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

/// How long a killed cgroup may take to empty before the agent gives up waiting.
const EMPTY_TIMEOUT: Duration = Duration::from_secs(10);

impl Cgroups {
    /// Opens (creating it) the base directory `mode` names for the agent whose work dir
    /// is `work_dir`, and proves it works by running a short process in a cgroup under
    /// it. `Ok(None)`: run without cgroups.
    pub fn open(mode: &CgroupMode, work_dir: &Path) -> Result<Option<Cgroups>, String> {
        let base = match mode {
            CgroupMode::Off => return Ok(None),
            CgroupMode::At(p) => p.clone(),
            CgroupMode::Auto => match own_cgroup_dir() {
                Some(own) => own.join(format!(
                    "allot-runners-{:016x}",
                    fnv1a(work_dir.as_os_str().as_encoded_bytes())
                )),
                None => {
                    warn!("no cgroup v2 hierarchy: runners are contained by their process group only (a runner's child that calls setsid() escapes the agent's kills)");
                    return Ok(None);
                }
            },
        };
        let cg = Cgroups { base };
        match cg.probe() {
            Ok(()) => Ok(Some(cg)),
            Err(e) if *mode == CgroupMode::Auto => {
                warn!(base = %cg.base.display(), "cgroup v2 is not usable here ({e}): runners are contained by their process group only (a runner's child that calls setsid() escapes the agent's kills); run the agent as root or with a delegated cgroup (systemd Delegate=yes)");
                let _ = std::fs::remove_dir(&cg.base);
                Ok(None)
            }
            Err(e) => Err(format!("--cgroup {}: {e}", cg.base.display())),
        }
    }

    /// Creates the base and runs `/bin/sh -c 'exit 0'` in a cgroup under it.
    fn probe(&self) -> Result<(), String> {
        std::fs::create_dir_all(&self.base).map_err(|e| e.to_string())?;
        if !self.base.join("cgroup.kill").exists() {
            return Err("not a cgroup v2 directory, or the kernel has no cgroup.kill (Linux 5.14 or later is needed)".into());
        }
        let probe = self
            .create(&format!("probe-{}", std::process::id()))
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

    /// Creates the cgroup `name` under the base.
    pub fn create(&self, name: &str) -> std::io::Result<Attempt> {
        let dir = self.base.join(name);
        std::fs::create_dir(&dir)?;
        Ok(Attempt { dir })
    }

    /// The cgroups under the base (a previous agent process's, at start).
    pub fn children(&self) -> Vec<Attempt> {
        let Ok(entries) = std::fs::read_dir(&self.base) else {
            return Vec::new();
        };
        let mut out: Vec<Attempt> = entries
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
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

    /// Sends `sig` to every process in the cgroup (SIGTERM: asks a runner's escaped
    /// children to save and stop too). A pid read here may end and, in principle, be
    /// reused before the signal: the window is one `kill(2)` after the read.
    pub fn signal(&self, sig: libc::c_int) {
        let Ok(s) = std::fs::read_to_string(self.dir.join("cgroup.procs")) else {
            return;
        };
        for pid in s
            .lines()
            .filter_map(|l| l.trim().parse::<libc::pid_t>().ok())
        {
            if pid > 1 {
                // SAFETY: kill(2) on a pid; no memory is shared.
                unsafe { libc::kill(pid, sig) };
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

    /// Kills everything in the cgroup, waits until it is empty, and removes it. `false`:
    /// still populated after the wait (left in place; the next agent process tries
    /// again).
    pub async fn kill_and_remove(&self) -> bool {
        self.kill();
        let until = Instant::now() + EMPTY_TIMEOUT;
        while self.populated() {
            if Instant::now() >= until {
                error!(cgroup = %self.dir.display(), "the attempt's cgroup is not empty {EMPTY_TIMEOUT:?} after cgroup.kill");
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        match std::fs::remove_dir(&self.dir) {
            Ok(()) => true,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
            Err(e) => {
                warn!(cgroup = %self.dir.display(), "cannot remove the attempt's cgroup: {e}");
                true
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
    let own = cgroup.lines().find_map(|l| l.strip_prefix("0::"))?.trim();
    // mountinfo: `id parent maj:min root mountpoint options [optional...] - fstype ...`.
    let (root, mountpoint) = mountinfo.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        if right.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        let mut f = left.split_whitespace();
        let root = f.nth(3)?;
        let mountpoint = f.next()?;
        Some((unescape(root), unescape(mountpoint)))
    })?;
    // The cgroup path is relative to the namespace's root; the mount shows `root` of it.
    let rel = Path::new(own).strip_prefix(&root).ok()?;
    if rel
        .components()
        .any(|c| c == std::path::Component::ParentDir)
    {
        return None;
    }
    Some(PathBuf::from(mountpoint).join(rel))
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
        assert_eq!(
            own_cgroup_dir_from(hybrid.lines().next().unwrap(), "0::/\n"),
            None
        );
        assert_eq!(own_cgroup_dir_from(pure, "1:name=systemd:/\n"), None);
        assert_eq!(unescape("/a\\040b"), "/a b");
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
