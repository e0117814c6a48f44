//! The disk-space guard: a node whose data directory's file system runs low on free
//! space refuses the writes that grow the ledger — tenants' and unresolved callers' —
//! before the disk is full, and keeps taking the ones that keep existing work alive
//! (agents' heartbeats and finishes), the operator's and its own.
//!
//! Why: every replica of a shard writes the same log. On a full disk a write fails,
//! the store's error stops that shard's Raft on the node, and replicas whose disks fill
//! together (the same volume, the same growth) all stop at once: the shard is gone
//! until an operator frees space and restarts them. Refusing growth at a low-water
//! mark keeps the cluster up in a documented, typed, degraded mode (the pattern of
//! etcd's `NOSPACE` alarm and of CockroachDB's ballast) until space is freed, then
//! lifts by itself. DESIGN §43 ("A disk running out").
//!
//! The guard is per node: it sees its own disk. A leader refuses what would grow its
//! log; a follower refuses before it forwards. A follower whose disk fills while its
//! leader's has room still stops (the shard goes on with the other replicas), as any
//! failing disk does.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// How often the free space is measured.
pub const DISK_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// The free space of a data directory's file system, and whether it is below the
/// node's low-water mark (`--min-free-disk-mib`).
pub struct DiskGuard {
    dir: PathBuf,
    /// Writes that grow the ledger are refused below this many free bytes (0: never).
    min_free: u64,
    /// Free bytes at the last measurement that succeeded (`NOT_MEASURED` before one).
    free: AtomicU64,
    low: AtomicBool,
    /// Whether the last measurement failed (logged when it starts failing).
    failing: AtomicBool,
}

const NOT_MEASURED: u64 = u64::MAX;

impl DiskGuard {
    /// A guard for `dir`, measured once now.
    pub fn new(dir: &Path, min_free: u64) -> DiskGuard {
        let g = DiskGuard {
            dir: dir.to_path_buf(),
            min_free,
            free: AtomicU64::new(NOT_MEASURED),
            low: AtomicBool::new(false),
            failing: AtomicBool::new(false),
        };
        g.check();
        g
    }

    /// Free bytes at the last measurement that succeeded (`None` before one).
    pub fn free(&self) -> Option<u64> {
        match self.free.load(Ordering::Relaxed) {
            NOT_MEASURED => None,
            f => Some(f),
        }
    }

    pub fn min_free(&self) -> u64 {
        self.min_free
    }

    /// Whether growth is refused now.
    pub fn low(&self) -> bool {
        self.low.load(Ordering::Relaxed)
    }

    /// Measures the free space and updates the state. A space that cannot be measured
    /// leaves the state as it was (warned when the measurements start failing: the
    /// guard is blind meanwhile).
    pub fn check(&self) {
        let free = match free_bytes(&self.dir) {
            Ok(f) => {
                self.failing.store(false, Ordering::Relaxed);
                f
            }
            Err(e) => {
                if !self.failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        dir = %self.dir.display(),
                        low = self.low(),
                        "cannot measure the data directory's free space (the disk guard \
                         keeps its last state until it can): {e}"
                    );
                }
                return;
            }
        };
        self.free.store(free, Ordering::Relaxed);
        self.low
            .store(next_low(self.low(), free, self.min_free), Ordering::Relaxed);
    }

    /// Whether, while the disk is low, a request of `actor` doing `command` is refused:
    /// one that grows the ledger for a tenant (an org's principal) or an unresolved
    /// caller — every command of theirs except those that end work (`CancelJob`,
    /// `ReleaseHold`). Agents', admins' and the node's own requests pass: they keep
    /// running work alive and let an operator act.
    pub fn refuses(
        &self,
        actor: Option<allot_statemachine::Actor>,
        command: Option<&allot_statemachine::Command>,
    ) -> bool {
        use crate::ratelimit::{key_of, Key};
        use allot_statemachine::Command;
        self.low()
            && matches!(key_of(actor), Some(Key::Org(_) | Key::Unresolved))
            && !matches!(
                command,
                Some(Command::CancelJob { .. } | Command::ReleaseHold { .. })
            )
    }

    /// While the disk is low, refuses a batch holding a request [`DiskGuard::refuses`]:
    /// `RESOURCE_EXHAUSTED`, reason `DISK_LOW`, with a retry hint.
    #[allow(clippy::result_large_err)]
    pub fn admit(
        &self,
        requests: &[allot_statemachine::Request],
        actors: &[(Option<allot_statemachine::Actor>, u32)],
    ) -> Result<(), tonic::Status> {
        let refused = requests
            .iter()
            .zip(actors)
            .any(|(r, (a, _))| self.refuses(*a, Some(&r.command)));
        if !refused {
            return Ok(());
        }
        Err(crate::ratelimit::exhausted_for(
            "DISK_LOW",
            &format!(
                "the node's disk has {} MiB free, below its mark of {} MiB: tenants' writes \
                 are refused until an operator frees space (reads, cancellations and \
                 agents' reports still run)",
                self.free().unwrap_or(0) >> 20,
                self.min_free >> 20
            ),
            DISK_CHECK_INTERVAL.as_millis() as u64 * 5,
        ))
    }
}

/// Below the mark: low. Low lifts only once the free space is a tenth above the mark
/// (at least 64 MiB above), so a node hovering at the mark does not flap.
pub fn next_low(was: bool, free: u64, min_free: u64) -> bool {
    if min_free == 0 {
        return false;
    }
    if was {
        free < min_free.saturating_add((min_free / 10).max(64 << 20))
    } else {
        free < min_free
    }
}

/// The bytes an unprivileged process may still write on `dir`'s file system.
pub fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: `path` is a valid NUL-terminated string and `st` a valid out pointer
    // for the duration of the call; statvfs writes only into it.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statvfs(path.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)] // the field types differ between platforms
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

/// Measures every `DISK_CHECK_INTERVAL` while the node lives; logs the state at start
/// when low, and each change.
pub async fn watch(node: std::sync::Weak<crate::node::Node>) {
    let mut every = tokio::time::interval(DISK_CHECK_INTERVAL);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut logged = false;
    loop {
        every.tick().await;
        let Some(node) = node.upgrade() else { return };
        let g = &node.disk;
        g.check();
        if let Some(free) = g.free() {
            node.metrics
                .disk_free_bytes
                .set(free.min(i64::MAX as u64) as i64);
        }
        node.metrics.disk_low.set(i64::from(g.low()));
        match (g.low(), logged) {
            (true, false) => tracing::error!(
                free = g.free().unwrap_or(0),
                min_free = g.min_free(),
                "the data directory's disk is nearly full: refusing tenants' writes \
                 (DISK_LOW) until space is freed; reads, agents' reports and operators' \
                 commands still run"
            ),
            (false, true) => tracing::warn!(
                free = g.free().unwrap_or(0),
                min_free = g.min_free(),
                "the data directory's disk has room again: taking every write"
            ),
            _ => {}
        }
        logged = g.low();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn low_below_the_mark_and_lifted_only_well_above_it() {
        let mib = 1u64 << 20;
        let mark = 1024 * mib;
        assert!(!next_low(false, mark, mark));
        assert!(next_low(false, mark - 1, mark));
        // Once low, the free space must pass the mark by a tenth (102.4 MiB here).
        assert!(next_low(true, mark + 100 * mib, mark));
        assert!(!next_low(true, mark + 103 * mib, mark));
        // A small mark still needs 64 MiB above it.
        assert!(next_low(true, 10 * mib + 63 * mib, 10 * mib));
        assert!(!next_low(true, 10 * mib + 64 * mib, 10 * mib));
        // 0: never low.
        assert!(!next_low(false, 0, 0) && !next_low(true, 0, 0));
    }

    #[test]
    fn the_free_space_of_a_real_directory_is_measured() {
        let dir = tempfile::tempdir().unwrap();
        let free = free_bytes(dir.path()).unwrap();
        assert!(free > 0);
        assert!(free_bytes(&dir.path().join("missing")).is_err());
        // An impossible mark: low at once; 0: never.
        assert!(DiskGuard::new(dir.path(), u64::MAX).low());
        assert!(!DiskGuard::new(dir.path(), 0).low());
    }

    /// While low: tenants' and unresolved callers' requests are refused, except those
    /// that end work; agents', admins' and the node's own pass.
    #[test]
    fn who_is_refused_while_the_disk_is_low() {
        use allot_statemachine::{Actor, Command, HoldId, JobId, NodeId, OrgId, PrincipalId};
        let dir = tempfile::tempdir().unwrap();
        let (low, fine) = (
            DiskGuard::new(dir.path(), u64::MAX),
            DiskGuard::new(dir.path(), 0),
        );
        let tenant = Some(Actor::Tenant {
            org: OrgId(1),
            principal: PrincipalId(2),
        });
        let grow = Command::CreateOrg { org: OrgId(3) };
        let cancel = Command::CancelJob { job: JobId(1) };
        let release = Command::ReleaseHold { hold: HoldId(1) };
        assert!(low.refuses(tenant, Some(&grow)));
        assert!(low.refuses(tenant, None), "a tenant's denial record");
        assert!(low.refuses(None, Some(&grow)));
        assert!(low.refuses(Some(Actor::Anonymous), None));
        assert!(!low.refuses(tenant, Some(&cancel)));
        assert!(!low.refuses(tenant, Some(&release)));
        let beat = Command::NodeHeartbeat { node: NodeId(1) };
        assert!(!low.refuses(Some(Actor::Agent(NodeId(1))), Some(&beat)));
        assert!(!low.refuses(Some(Actor::Admin(PrincipalId(1))), Some(&grow)));
        assert!(!low.refuses(Some(Actor::System), Some(&grow)));
        assert!(!fine.refuses(tenant, Some(&grow)));
        assert!(fine.free().is_some() && low.free().is_some());
    }
}
