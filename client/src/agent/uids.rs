//! A uid of its own for every attempt (`--runner-uid-range FIRST-LAST`).
//!
//! With one `--runner-user`, every runner on a node is the same user, and a user may
//! signal its own processes: one org's job could `kill(-1, SIGKILL)` every other org's
//! runner on the node, trace it (`ptrace`, `/proc/<pid>/mem` — same uid), or read the
//! files it writes with its umask. With a range, the agent hands each attempt a uid (and
//! the group of the same number) no other running attempt has, and no account of the
//! host has (the range is refused at start if the user or group database names any id in
//! it): runners of different attempts are different users to the kernel.
//!
//! A uid goes back to the pool only once no process runs as it: when an attempt ends,
//! the agent *sweeps* the uid — a child of the agent that switched to it sends
//! `kill(-1, SIGKILL)`, which reaches every process whose real or saved uid is that one
//! (whatever process group or cgroup it is in) — and sweeps it again before it hands it
//! out. So even without cgroups (`--cgroup off`, or a kernel without `cgroup.kill`)
//! nothing an attempt started outlives it, and a uid's next holder never shares it with
//! a previous holder's process. A uid whose processes do not die (stuck in the kernel)
//! is skipped until they do. Uids are handed out round robin, so a uid is used again as
//! late as the range allows.
//!
//! Each attempt gets a home directory of its own (`<work dir>/homes/<uid>`, mode 0700,
//! owned by the uid; `HOME` and `TMPDIR` point at it), removed when the attempt ends and
//! made afresh for the next holder. Files a runner leaves in world-writable directories
//! of the host (`/tmp`, `/dev/shm`) stay, owned by its uid, and a later holder of the
//! uid could read them: point job code at `TMPDIR`, and keep the range as large as the
//! host allows (docs/DESIGN.md §45, "A uid per attempt").

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::{error, warn};

/// The most uids a range may hold (the user database is read once over it at start).
pub const RANGE_MAX: u32 = 1 << 20;
/// How long a sweep waits for the uid's processes to be gone before it gives up on the
/// uid for now.
const SWEEP_FOR: Duration = Duration::from_secs(5);

/// `FIRST-LAST`, inclusive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UidRange {
    pub first: u32,
    pub last: u32,
}

impl std::str::FromStr for UidRange {
    type Err = String;

    fn from_str(s: &str) -> Result<UidRange, String> {
        let (a, b) = s
            .split_once('-')
            .ok_or_else(|| format!("{s:?}: expected FIRST-LAST, e.g. 2000000-2000063"))?;
        let num = |t: &str| {
            t.trim()
                .parse::<u32>()
                .map_err(|e| format!("{s:?}: {t:?} is not a uid: {e}"))
        };
        let r = UidRange {
            first: num(a)?,
            last: num(b)?,
        };
        if r.first > r.last {
            return Err(format!("{s:?}: the range is empty (FIRST above LAST)"));
        }
        Ok(r)
    }
}

impl std::fmt::Display for UidRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.first, self.last)
    }
}

impl UidRange {
    pub fn size(&self) -> u32 {
        self.last - self.first + 1
    }

    pub fn contains(&self, id: u32) -> bool {
        (self.first..=self.last).contains(&id)
    }

    /// What the range itself must be, whatever the host: no root, none of the ids that
    /// mean "no id" (65535 and 2³²−1: `(uid_t)-1` and its 16-bit form), at least one uid
    /// per GPU (an attempt holds at least one GPU), at most [`RANGE_MAX`].
    pub fn check_shape(&self, gpus: u32) -> Result<(), String> {
        if self.first == 0 {
            return Err(format!("{self}: runners must not run as root (uid 0)"));
        }
        if self.contains(65_535) || self.contains(u32::MAX) {
            return Err(format!(
                "{self}: contains 65535 or 4294967295, which mean \"no id\" to the kernel"
            ));
        }
        if self.size() < gpus {
            return Err(format!(
                "{self}: {} uids for {gpus} GPUs: give at least one per GPU (an attempt holds at least one)",
                self.size()
            ));
        }
        if self.size() > RANGE_MAX {
            return Err(format!("{self}: at most {RANGE_MAX} uids"));
        }
        Ok(())
    }

    /// The host's side: the agent is root (only root switches users), and neither the
    /// user nor the group database names an id in the range — a uid of the range must
    /// belong to no one but the attempt holding it.
    pub fn check_host(&self) -> Result<(), String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err(format!(
                "{self}: the agent must run as root to start runners as other users"
            ));
        }
        if let Some((name, id)) = database_ids(Database::Users)
            .into_iter()
            .find(|(_, id)| self.contains(*id))
        {
            return Err(format!(
                "{self}: user {name} has uid {id}: the range must be reserved for allot's runners"
            ));
        }
        if let Some((name, id)) = database_ids(Database::Groups)
            .into_iter()
            .find(|(_, id)| self.contains(*id))
        {
            return Err(format!(
                "{self}: group {name} has gid {id}: the range must be reserved for allot's runners"
            ));
        }
        // Directory services (LDAP, SSSD) often do not enumerate: a small range is
        // looked up id by id as well.
        if self.size() <= LOOKUP_MAX {
            for id in self.first..=self.last {
                if let Some(name) = user_of(id) {
                    return Err(format!(
                        "{self}: user {name} has uid {id}: the range must be reserved for allot's runners"
                    ));
                }
                if let Some(name) = group_of(id) {
                    return Err(format!(
                        "{self}: group {name} has gid {id}: the range must be reserved for allot's runners"
                    ));
                }
            }
        }
        // A user's subordinate ids (rootless containers) are ids that user can become.
        for file in ["/etc/subuid", "/etc/subgid"] {
            if let Ok(text) = std::fs::read_to_string(file) {
                if let Some(line) = subordinate_overlap(&text, self) {
                    return Err(format!(
                        "{self}: {file} gives {line}, which overlaps it: those ids can be taken by that user"
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Ranges of at most this many uids are also looked up id by id at start.
const LOOKUP_MAX: u32 = 4096;

/// The first `name:start:count` line of a subuid/subgid file whose ids overlap `r`.
fn subordinate_overlap<'a>(text: &'a str, r: &UidRange) -> Option<&'a str> {
    text.lines().map(str::trim).find(|line| {
        let mut f = line.split(':');
        let (Some(_), Some(start), Some(count)) = (f.next(), f.next(), f.next()) else {
            return false;
        };
        let (Ok(start), Ok(count)) = (start.parse::<u64>(), count.parse::<u64>()) else {
            return false;
        };
        count > 0 && start <= r.last as u64 && start + count > r.first as u64
    })
}

/// The user database's name for `uid`, if it has one (through NSS).
fn user_of(uid: u32) -> Option<String> {
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: getpwuid_r writes only into `pwd` and `buf`, which outlive the call; the
    // name it points at lives in `buf` and is copied out before `buf` is dropped.
    let rc = unsafe { libc::getpwuid_r(uid, &mut pwd, buf.as_mut_ptr(), buf.len(), &mut found) };
    (rc == 0 && !found.is_null()).then(|| {
        unsafe { std::ffi::CStr::from_ptr(pwd.pw_name) }
            .to_string_lossy()
            .into_owned()
    })
}

/// The group database's name for `gid`, if it has one (through NSS).
fn group_of(gid: u32) -> Option<String> {
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 64 * 1024];
    let mut found: *mut libc::group = std::ptr::null_mut();
    // SAFETY: as for `user_of`.
    let rc = unsafe { libc::getgrgid_r(gid, &mut grp, buf.as_mut_ptr(), buf.len(), &mut found) };
    (rc == 0 && !found.is_null()).then(|| {
        unsafe { std::ffi::CStr::from_ptr(grp.gr_name) }
            .to_string_lossy()
            .into_owned()
    })
}

enum Database {
    Users,
    Groups,
}

/// Every (name, id) of the user or group database (through NSS, as `getent` lists them).
fn database_ids(db: Database) -> Vec<(String, u32)> {
    // getpwent/getgrent keep a cursor of their own: one reader at a time in the process.
    static LOCK: Mutex<()> = Mutex::new(());
    let _g = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let mut out = Vec::new();
    // SAFETY: the entries are read (name copied out) before the next call reuses their
    // storage, and the lock above keeps other readers of the cursor out.
    unsafe {
        match db {
            Database::Users => {
                libc::setpwent();
                loop {
                    let p = libc::getpwent();
                    if p.is_null() {
                        break;
                    }
                    let name = std::ffi::CStr::from_ptr((*p).pw_name)
                        .to_string_lossy()
                        .into_owned();
                    out.push((name, (*p).pw_uid));
                }
                libc::endpwent();
            }
            Database::Groups => {
                libc::setgrent();
                loop {
                    let g = libc::getgrent();
                    if g.is_null() {
                        break;
                    }
                    let name = std::ffi::CStr::from_ptr((*g).gr_name)
                        .to_string_lossy()
                        .into_owned();
                    out.push((name, (*g).gr_gid));
                }
                libc::endgrent();
            }
        }
    }
    out
}

/// What a sweep of a uid found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Swept {
    /// No process runs as the uid.
    Clean,
    /// Processes were still signalled when the sweep gave up.
    Stuck,
}

/// Sends SIGKILL to every process running as `uid`, from a child that switched to it,
/// until none is left (or [`SWEEP_FOR`] passes). Blocking: call off the runtime.
///
/// It always signals once, whatever `/proc` says first: a process whose main thread
/// exited while others run shows as a zombie in its own status. A sweeper that the
/// uid's processes stop or kill (they may signal it once it is their uid) is killed
/// after [`SWEEPER_FOR`] and another one sent, as is one that could not be forked
/// (a fork bomb of the uid may exhaust the pids for a while) — until [`SWEEP_FOR`].
pub fn sweep(uid: u32) -> std::io::Result<Swept> {
    let until = std::time::Instant::now() + SWEEP_FOR;
    loop {
        match kill_all_as(uid) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {}
            Err(e) => return Err(e),
        }
        if processes_of(uid) == 0 {
            return Ok(Swept::Clean);
        }
        if std::time::Instant::now() >= until {
            return Ok(Swept::Stuck);
        }
        // Killed processes are gone once their parents (or init) reap them.
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// How many live processes have `uid` as their real, effective or saved uid, from
/// `/proc` (the agent's pid namespace). A process counts while any of its threads is
/// not a zombie (zombies run nothing). If `/proc` cannot be read, `usize::MAX`: never
/// "none".
pub fn processes_of(uid: u32) -> usize {
    processes_in(Path::new("/proc"), uid)
}

fn processes_in(proc_dir: &Path, uid: u32) -> usize {
    let Ok(dir) = std::fs::read_dir(proc_dir) else {
        return usize::MAX;
    };
    dir.flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        })
        // A process that exits meanwhile has no status: not counted.
        .filter(|e| process_runs_as(&e.path(), uid))
        .count()
}

/// Whether `/proc/<pid>` (`dir`) is a process running as `uid` with a live thread.
fn process_runs_as(dir: &Path, uid: u32) -> bool {
    let Ok(status) = std::fs::read_to_string(dir.join("status")) else {
        return false;
    };
    let (state, ids) = status_fields(&status);
    // Real, effective, saved (the fourth, the filesystem uid, follows the effective).
    if !ids.iter().take(3).any(|&i| i == uid) {
        return false;
    }
    if !is_zombie(state) {
        return true;
    }
    // A zombie leader may still have live threads: its task list says.
    std::fs::read_dir(dir.join("task")).is_ok_and(|tasks| {
        tasks.flatten().any(|t| {
            std::fs::read_to_string(t.path().join("status"))
                .is_ok_and(|st| !is_zombie(status_fields(&st).0))
        })
    })
}

/// The `State:` letter and the `Uid:` ids of a `/proc/<pid>/status` text.
fn status_fields(status: &str) -> (char, Vec<u32>) {
    let mut state = '?';
    let mut ids = Vec::new();
    for line in status.lines() {
        if let Some(v) = line.strip_prefix("State:") {
            state = v.trim_start().chars().next().unwrap_or('?');
        } else if let Some(v) = line.strip_prefix("Uid:") {
            ids = v
                .split_whitespace()
                .filter_map(|t| t.parse().ok())
                .collect();
        }
    }
    (state, ids)
}

fn is_zombie(state: char) -> bool {
    matches!(state, 'Z' | 'X' | 'x')
}

/// How long one sweeping child may take before the agent kills it (the uid's processes
/// may stop it once it has their uid) and sends another.
const SWEEPER_FOR: Duration = Duration::from_millis(100);

/// One `kill(-1, SIGKILL)` as `uid`, which reaches every process whose real or saved
/// uid is `uid` but the caller. The child is waited for [`SWEEPER_FOR`] at most, then
/// killed.
fn kill_all_as(uid: u32) -> std::io::Result<()> {
    let until = std::time::Instant::now() + SWEEPER_FOR;
    let lock_fd = super::work_dir_lock_fd();
    // SAFETY: between fork and _exit the child makes only async-signal-safe calls
    // (close, setgroups, setgid, setuid, kill, _exit) on values computed before the fork.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if pid == 0 {
        unsafe {
            // Its copy of the work dir's lock: a sweeper the uid's processes stop must
            // not keep the work dir from the agent's successor.
            if lock_fd >= 0 {
                libc::close(lock_fd);
            }
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(uid) != 0
                || libc::setuid(uid) != 0
            {
                libc::_exit(3);
            }
            libc::kill(-1, libc::SIGKILL);
            libc::_exit(0);
        }
    }
    let mut status = 0;
    let mut killed = false;
    loop {
        // SAFETY: polls the child forked above, which nothing else reaps.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            break;
        }
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if !killed && std::time::Instant::now() >= until {
            // Stopped or stuck: the agent (root) may always kill its own child.
            // SAFETY: `pid` is our unreaped child, so it cannot have been reused.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            killed = true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 3 {
        return Err(std::io::Error::other(format!(
            "the sweep of uid {uid} could not switch to it"
        )));
    }
    // Exited after its kill, or killed (by the uid's processes, or by us past the
    // deadline): the caller looks at /proc and tries again while time is left.
    Ok(())
}

/// The uids of a range, handed to attempts one at a time.
pub struct UidPool {
    range: UidRange,
    /// `<work dir>/homes`: each attempt's home is `<uid>` in it.
    homes: PathBuf,
    state: Mutex<PoolState>,
}

struct PoolState {
    in_use: BTreeSet<u32>,
    /// Where the round robin goes on from.
    next: u32,
}

/// An attempt's uid, until [`UidPool::release`].
#[derive(Debug)]
pub struct UidLease {
    pub uid: u32,
    /// The attempt's home directory, owned by `uid`.
    pub home: PathBuf,
}

impl UidLease {
    /// The name runners see in `USER` and `LOGNAME` (the uid has no account).
    pub fn name(&self) -> String {
        format!("allot-{}", self.uid)
    }
}

impl UidPool {
    /// A pool over `range`, with its homes under `work_dir` (which must be 0711 or
    /// closer, so that a runner can reach its home by name and list nothing).
    pub fn new(range: UidRange, work_dir: &Path) -> std::io::Result<Arc<UidPool>> {
        use std::os::unix::fs::PermissionsExt;
        let homes = work_dir.join("homes");
        std::fs::create_dir_all(&homes)?;
        std::fs::set_permissions(&homes, std::fs::Permissions::from_mode(0o711))?;
        Ok(Arc::new(UidPool {
            range,
            homes,
            state: Mutex::new(PoolState {
                in_use: BTreeSet::new(),
                next: range.first,
            }),
        }))
    }

    /// At start: the homes a previous agent process left are those of the attempts it
    /// was running when it ended (a release removes its home): their uids are swept (a
    /// process that escaped its cgroup, or ran without one, dies now rather than when
    /// its uid comes round again) and the homes removed. How many uids were swept.
    pub async fn recover(self: &Arc<Self>) -> usize {
        let pool = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            let Ok(entries) = std::fs::read_dir(&pool.homes) else {
                return 0;
            };
            let mut swept = 0;
            for e in entries.flatten() {
                let uid = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok());
                if uid.is_some_and(|u| !pool.range.contains(u)) {
                    // A home of another range (the flag changed): its uid may be
                    // someone's now, so it is not swept.
                    warn!(path = %e.path().display(), "a runner home outside --runner-uid-range: removed, its uid not swept");
                }
                if let Some(uid) = uid.filter(|u| pool.range.contains(*u)) {
                    match sweep(uid) {
                        Ok(Swept::Clean) => {}
                        Ok(Swept::Stuck) => {
                            error!(uid, "processes of a previous agent's runner uid survive SIGKILL")
                        }
                        Err(err) => error!(uid, "cannot sweep a previous agent's runner uid: {err}"),
                    }
                    swept += 1;
                }
                if let Err(err) = remove_tree(&e.path()) {
                    warn!(path = %e.path().display(), "cannot remove a previous agent's runner home: {err}");
                }
            }
            swept
        })
        .await
        .unwrap_or(0)
    }

    /// A uid no running attempt holds, swept clean, with a fresh home. Fails if every
    /// uid is held or none could be swept.
    pub async fn take(self: &Arc<Self>) -> std::io::Result<UidLease> {
        let pool = Arc::clone(self);
        tokio::task::spawn_blocking(move || pool.take_blocking())
            .await
            .map_err(std::io::Error::other)?
    }

    fn take_blocking(&self) -> std::io::Result<UidLease> {
        let mut tried = 0u32;
        while tried < self.range.size() {
            let Some(uid) = self.reserve_next(&mut tried) else {
                break;
            };
            match sweep(uid).and_then(|s| match s {
                Swept::Clean => self.fresh_home(uid),
                Swept::Stuck => Err(std::io::Error::other("processes of it do not die")),
            }) {
                Ok(home) => return Ok(UidLease { uid, home }),
                Err(e) => {
                    warn!(uid, "runner uid skipped for now: {e}");
                    self.free(uid);
                }
            }
        }
        Err(std::io::Error::other(format!(
            "no runner uid of {} is free",
            self.range
        )))
    }

    /// Marks the next uid (round robin) that is not in use as in use.
    fn reserve_next(&self, tried: &mut u32) -> Option<u32> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        while *tried < self.range.size() {
            *tried += 1;
            let uid = st.next;
            st.next = if uid == self.range.last {
                self.range.first
            } else {
                uid + 1
            };
            if st.in_use.insert(uid) {
                return Some(uid);
            }
        }
        None
    }

    fn free(&self, uid: u32) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.in_use.remove(&uid);
    }

    /// Removes whatever a previous holder left in the uid's home and makes it anew.
    fn fresh_home(&self, uid: u32) -> std::io::Result<PathBuf> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        let home = self.homes.join(uid.to_string());
        remove_tree(&home)?;
        std::fs::DirBuilder::new().mode(0o700).create(&home)?;
        std::os::unix::fs::chown(&home, Some(uid), Some(uid))?;
        std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o700))?;
        Ok(home)
    }

    /// The attempt is over (its runner exited and was reaped): every process of its uid
    /// is killed, its home removed, and the uid freed — kept out of the pool if its
    /// processes would not die.
    pub async fn release(self: &Arc<Self>, lease: UidLease) {
        self.sweep_ended(&lease).await;
        self.remove_home_and_free(lease).await;
    }

    /// The first half of [`UidPool::release`]: every process of the ended attempt's uid
    /// is killed (as far as it will die; `take` sweeps it again before reuse).
    pub async fn sweep_ended(&self, lease: &UidLease) {
        let uid = lease.uid;
        let done = tokio::task::spawn_blocking(move || match sweep(uid) {
            Ok(Swept::Clean) => {}
            Ok(Swept::Stuck) => error!(
                uid,
                "processes of an ended attempt's uid survive SIGKILL: swept again before reuse"
            ),
            Err(e) => error!(uid, "cannot sweep an ended attempt's uid: {e}"),
        })
        .await;
        if let Err(e) = done {
            error!("sweeping a runner uid failed: {e}");
        }
    }

    /// The second half of [`UidPool::release`]: the attempt's home is removed and the
    /// uid freed (freed even if not yet swept clean: `take` sweeps it again and skips it
    /// while processes of it live); not freed if its home cannot be removed (its next
    /// holder would get the previous holder's files).
    pub async fn remove_home_and_free(self: &Arc<Self>, lease: UidLease) {
        let pool = Arc::clone(self);
        let done = tokio::task::spawn_blocking(move || match remove_tree(&lease.home) {
            Ok(()) => pool.free(lease.uid),
            Err(e) => error!(
                uid = lease.uid,
                "cannot remove the attempt's home, so the uid is held back until the agent restarts: {e}"
            ),
        })
        .await;
        if let Err(e) = done {
            error!("releasing a runner uid failed: {e}");
        }
    }

    /// The uids held now.
    #[cfg(test)]
    pub fn in_use(&self) -> Vec<u32> {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.in_use.iter().copied().collect()
    }
}

/// How long removing an attempt's home may take before the uid is held back.
const REMOVE_FOR: Duration = Duration::from_secs(120);

/// Removes a directory tree a runner wrote; absent is fine. In a child process
/// (`rm -rf --one-file-system`, which walks any depth in bounded memory and file
/// descriptors, and never follows a symlink out of the tree): a tree nested deep
/// enough to exhaust the agent's descriptors or overflow a thread's stack (std's
/// `remove_dir_all` recurses) costs only that child. Bounded at [`REMOVE_FOR`].
fn remove_tree(path: &Path) -> std::io::Result<()> {
    if std::fs::symlink_metadata(path).is_err() {
        return Ok(());
    }
    let mut child = std::process::Command::new("rm")
        .args(["-rf", "--one-file-system", "--"])
        .arg(path)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()?;
    let until = std::time::Instant::now() + REMOVE_FOR;
    loop {
        if let Some(st) = child.try_wait()? {
            return if st.success() && std::fs::symlink_metadata(path).is_err() {
                Ok(())
            } else {
                Err(std::io::Error::other(format!(
                    "rm -rf {} failed ({st})",
                    path.display()
                )))
            };
        }
        if std::time::Instant::now() >= until {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::other(format!(
                "removing {} took longer than {REMOVE_FOR:?}",
                path.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_is_parsed_and_its_shape_checked() {
        let r: UidRange = "2000000-2000003".parse().unwrap();
        assert_eq!((r.first, r.last, r.size()), (2_000_000, 2_000_003, 4));
        assert!(r.check_shape(4).is_ok());
        assert!(r
            .check_shape(5)
            .unwrap_err()
            .contains("at least one per GPU"));
        for bad in ["", "5", "a-b", "7-3", "1-", "-4", "1-2-3"] {
            assert!(bad.parse::<UidRange>().is_err(), "{bad:?} parsed");
        }
        let shape = |s: &str| s.parse::<UidRange>().unwrap().check_shape(1);
        assert!(shape("0-10").unwrap_err().contains("root"));
        assert!(shape("65000-66000").unwrap_err().contains("no id"));
        assert!(shape("4294967200-4294967295")
            .unwrap_err()
            .contains("no id"));
        assert!(shape("100000-2000000").unwrap_err().contains("at most"));
    }

    #[test]
    fn a_range_naming_an_account_of_the_host_is_refused() {
        // Every host has root in its user and group databases.
        let r: UidRange = "0-0".parse().unwrap();
        if unsafe { libc::geteuid() } == 0 {
            let e = r.check_host().unwrap_err();
            assert!(e.contains("user root has uid 0"), "{e}");
        } else {
            assert!(r.check_host().unwrap_err().contains("must run as root"));
        }
    }

    /// A `/proc`-like directory: each process's status, and its threads' statuses.
    fn fake_proc(procs: &[(u32, &str, &str, &[&str])]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let status = |state: &str, ids: &str| {
            format!("Name:\tsh\nState:\t{state}\nUid:\t{ids}\nGid:\t0\t0\t0\t0\n")
        };
        for (pid, state, ids, threads) in procs {
            let p = dir.path().join(pid.to_string());
            std::fs::create_dir_all(p.join("task")).unwrap();
            std::fs::write(p.join("status"), status(state, ids)).unwrap();
            for (i, t) in threads.iter().enumerate() {
                let t_dir = p.join("task").join((pid + i as u32).to_string());
                std::fs::create_dir_all(&t_dir).unwrap();
                std::fs::write(t_dir.join("status"), status(t, ids)).unwrap();
            }
        }
        std::fs::create_dir_all(dir.path().join("self")).unwrap();
        dir
    }

    /// Found by review (twelfth session): a process whose main thread exited while
    /// another thread runs shows `Z` in its own status, and the first sweep counted it
    /// as gone — without ever signalling it.
    #[test]
    fn a_process_runs_as_a_uid_if_its_real_effective_or_saved_uid_is_it_and_a_thread_lives() {
        let z: &[&str] = &["Z (zombie)"];
        let procs = fake_proc(&[
            (10, "S (sleeping)", "7\t7\t7\t7", &["S (sleeping)"]),
            (20, "R (running)", "1\t1\t7\t1", &["R (running)"]),
            (30, "Z (zombie)", "7\t7\t7\t7", z),
            (
                40,
                "Z (zombie)",
                "7\t7\t7\t7",
                &["Z (zombie)", "S (sleeping)"],
            ),
            (50, "S (sleeping)", "1\t1\t1\t7", &["S (sleeping)"]),
            (60, "S (sleeping)", "70\t70\t70\t70", &["S (sleeping)"]),
        ]);
        let runs = |pid: u32| process_runs_as(&procs.path().join(pid.to_string()), 7);
        assert!(runs(10));
        assert!(runs(20), "saved uid");
        assert!(!runs(30), "a zombie runs nothing");
        assert!(runs(40), "a zombie leader whose other thread lives");
        assert!(!runs(50), "the fs uid alone");
        assert!(!runs(60));
        assert_eq!(processes_in(procs.path(), 7), 3);
        // This test's own process is counted under its uid, and a uid no process has is not.
        let me = unsafe { libc::getuid() };
        assert!(processes_of(me) >= 1);
        assert_eq!(processes_of(3_999_999_999), 0);
    }

    /// A tree far deeper than a thread's stack or the descriptor limit allows std's
    /// recursive removal to walk is removed (by a child `rm`), and a missing one is fine.
    #[test]
    fn a_deep_tree_is_removed_whole() {
        // Few descriptors (nextest runs each test in a process of its own): a walk that
        // holds one per level, as std's `remove_dir_all` does, runs out long before the
        // tree's 3,000 levels.
        let lim = libc::rlimit {
            rlim_cur: 256,
            rlim_max: 256,
        };
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("home");
        let mut p = home.clone();
        std::fs::create_dir(&p).unwrap();
        // Built relative to the last directory, since the full path passes PATH_MAX.
        let mut cur = std::fs::File::open(&p).unwrap();
        for _ in 0..3_000 {
            use std::os::fd::AsRawFd;
            let name = std::ffi::CString::new("d").unwrap();
            assert_eq!(
                unsafe { libc::mkdirat(cur.as_raw_fd(), name.as_ptr(), 0o700) },
                0
            );
            let fd = unsafe {
                libc::openat(
                    cur.as_raw_fd(),
                    name.as_ptr(),
                    libc::O_RDONLY | libc::O_DIRECTORY,
                )
            };
            assert!(fd >= 0);
            cur = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        }
        p.push("d");
        assert!(p.exists());
        remove_tree(&home).unwrap();
        assert!(!home.exists());
        remove_tree(&home).unwrap();
    }

    /// Found by review (twelfth session): a user's subordinate ids (`/etc/subuid`, the
    /// ids its rootless containers map to) were not checked, and Debian's default
    /// allocation (100000 + 65536·n) reaches the shipped unit's range at the 30th user.
    #[test]
    fn subordinate_ids_that_overlap_the_range_are_found() {
        let text = "alice:100000:65536\n# comment\nbob:2031616:65536\nbad line\n";
        let r = |s: &str| s.parse::<UidRange>().unwrap();
        assert_eq!(subordinate_overlap(text, &r("2000000-2000255")), None);
        assert_eq!(
            subordinate_overlap(text, &r("165535-165600")),
            Some("alice:100000:65536")
        );
        assert_eq!(
            subordinate_overlap(text, &r("2000000-2031616")),
            Some("bob:2031616:65536")
        );
        assert_eq!(subordinate_overlap(text, &r("165536-2031615")), None);
        // Every host has root: a one-id range of it is found by the lookup too.
        assert_eq!(user_of(0).as_deref(), Some("root"));
        assert_eq!(user_of(3_999_999_999), None);
    }

    #[test]
    fn uids_go_round_robin_and_one_in_use_is_never_handed_out_twice() {
        let dir = tempfile::tempdir().unwrap();
        let pool = UidPool::new("3000000-3000002".parse().unwrap(), dir.path()).unwrap();
        let mut tried = 0;
        let a = pool.reserve_next(&mut tried).unwrap();
        let mut tried = 0;
        let b = pool.reserve_next(&mut tried).unwrap();
        let mut tried = 0;
        let c = pool.reserve_next(&mut tried).unwrap();
        assert_eq!((a, b, c), (3_000_000, 3_000_001, 3_000_002));
        let mut tried = 0;
        assert_eq!(pool.reserve_next(&mut tried), None, "all three held");
        pool.free(b);
        let mut tried = 0;
        assert_eq!(pool.reserve_next(&mut tried), Some(b));
        pool.free(a);
        pool.free(c);
        // The round robin goes on after the last uid handed out, not from the first.
        let mut tried = 0;
        assert_eq!(pool.reserve_next(&mut tried), Some(c));
        assert_eq!(pool.in_use(), vec![b, c]);
    }
}
