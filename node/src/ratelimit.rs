//! Per-tenant limits at the gRPC edge, on by default: token buckets for writes
//! (`Execute` requests) and for reads (queries, audit pages, stream opens, status), and
//! bounds on concurrent streams (per principal, per org — its quota's `streams_max` —
//! and per node). A tenant is an org — whichever of its tokens (org,
//! project) it uses —, an agent's node, or an admin principal; callers whose token does
//! not resolve on this replica share one bucket. Over its limit a caller gets
//! `RESOURCE_EXHAUSTED` with `retry-after-ms` and reason `RATE_LIMITED`, before
//! anything is proposed or read. Limits are per node (each node limits the calls it
//! receives; a call forwarded by an authenticated peer was limited there).

use crate::edge::with_reason;
use crate::limits::{STREAMS_PER_NODE_MAX, STREAMS_PER_PRINCIPAL_MAX};
use crate::server::RETRY_AFTER_MS;
use allot_statemachine::Actor;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tonic::metadata::MetadataValue;
use tonic::Status;

/// Who a limit applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Key {
    Org(u64),
    Agent(u64),
    Admin(u64),
    /// Every caller whose credentials did not resolve on this replica, together.
    Unresolved,
    /// One tenant principal, by org and principal id (stream bounds: each of an org's
    /// tokens' identities; principal ids are per org).
    Principal(u64, u64),
}

/// The limit key of a resolved actor (`None`: unresolved). The node's own `System`
/// requests are never limited.
pub fn key_of(actor: Option<Actor>) -> Option<Key> {
    Some(match actor {
        Some(Actor::Tenant { org, .. } | Actor::Project { org, .. } | Actor::User { org, .. }) => {
            Key::Org(org.0)
        }
        Some(Actor::Agent(n)) => Key::Agent(n.0),
        Some(Actor::Admin(p)) => Key::Admin(p.0),
        Some(Actor::System) => return None,
        Some(Actor::Anonymous | Actor::Bearer(_)) | None => Key::Unresolved,
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Class {
    Write,
    Read,
}

/// A rate: tokens per second and a burst; 0 per second disables it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rate {
    pub per_sec: u32,
    pub burst: u32,
}

impl Rate {
    /// A rate whose burst is [`SHORT_BURST_SECS`] of it (admins, unresolved callers).
    pub const fn with_short_burst(per_sec: u32) -> Rate {
        Rate {
            per_sec,
            burst: per_sec.saturating_mul(SHORT_BURST_SECS),
        }
    }
}

/// Seconds of their rate admins and unresolved callers may send at once.
pub const SHORT_BURST_SECS: u32 = 5;

/// The node's limits (`allot-node run --rate-limit ...`; the flags' defaults are
/// [`Limits::default`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Write requests per tenant (org, agent node).
    pub write: Rate,
    /// Reads (queries, audit pages, stream opens, status) per tenant.
    pub read: Rate,
    /// Writes and reads of admin principals.
    pub admin: Rate,
    /// Calls whose credentials do not resolve here, all together.
    pub unresolved: Rate,
}

/// The defaults (the node's flags default to these). Sized for the seed's load: tens
/// of thousands of accounts, one heartbeat per running job every 30–60 s, an
/// enterprise that submits 10,000 jobs at once (the write burst takes them in one go;
/// the sustained rate is 6–12× the job heartbeats of a tenant running 10,000 jobs).
/// Admins are not limited by default.
pub const DEFAULT_LIMITS: Limits = Limits {
    write: Rate {
        per_sec: 2_000,
        burst: 20_000,
    },
    read: Rate {
        per_sec: 1_000,
        burst: 5_000,
    },
    admin: Rate::with_short_burst(0),
    unresolved: Rate::with_short_burst(200),
};

impl Default for Limits {
    fn default() -> Self {
        DEFAULT_LIMITS
    }
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

pub struct RateLimiter {
    limits: Limits,
    buckets: Mutex<HashMap<(Class, Key), Bucket>>,
    streams: Arc<Mutex<StreamCounts>>,
}

/// Buckets kept before full ones are dropped (bounded memory under id churn: a full
/// bucket is what a new one would be).
const BUCKETS_MAX: usize = 100_000;

#[derive(Default, Debug)]
struct StreamCounts {
    total: usize,
    by_key: HashMap<Key, usize>,
}

/// An open stream's place; released when dropped (the stream ended or its client left).
#[derive(Debug)]
pub struct StreamSlot {
    keys: Vec<Key>,
    counts: Arc<Mutex<StreamCounts>>,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        c.total = c.total.saturating_sub(1);
        for key in &self.keys {
            if let Some(n) = c.by_key.get_mut(key) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    c.by_key.remove(key);
                }
            }
        }
    }
}

/// What one open stream counts against, each with its bound: the principal (an agent's
/// node), and for a tenant its org with the org's `streams_max` (`org_streams_max`).
/// `None` for the node's own `System` actor.
pub fn stream_keys(who: Actor, org_streams_max: Option<u32>) -> Option<Vec<(Key, usize)>> {
    let principal = |org: allot_statemachine::OrgId, p: allot_statemachine::PrincipalId| {
        (Key::Principal(org.0, p.0), STREAMS_PER_PRINCIPAL_MAX)
    };
    Some(match who {
        Actor::Tenant { org, principal: p }
        | Actor::Project {
            org, principal: p, ..
        }
        | Actor::User {
            org, principal: p, ..
        } => vec![
            principal(org, p),
            (
                Key::Org(org.0),
                org_streams_max.map_or(STREAMS_PER_PRINCIPAL_MAX, |m| m as usize),
            ),
        ],
        Actor::Admin(p) => vec![(Key::Admin(p.0), STREAMS_PER_PRINCIPAL_MAX)],
        Actor::Agent(n) => vec![(Key::Agent(n.0), STREAMS_PER_PRINCIPAL_MAX)],
        Actor::System => return None,
        Actor::Anonymous | Actor::Bearer(_) => {
            vec![(Key::Unresolved, STREAMS_PER_PRINCIPAL_MAX)]
        }
    })
}

fn exhausted(what: &str, retry_after_ms: u64) -> Status {
    exhausted_for("RATE_LIMITED", what, retry_after_ms)
}

/// `RESOURCE_EXHAUSTED` with `reason` and a retry hint.
pub(crate) fn exhausted_for(reason: &str, what: &str, retry_after_ms: u64) -> Status {
    let mut s = with_reason(Status::resource_exhausted(what.to_string()), reason);
    if let Ok(v) = MetadataValue::try_from(retry_after_ms.to_string()) {
        s.metadata_mut().insert(RETRY_AFTER_MS, v);
    }
    s
}

impl RateLimiter {
    pub fn new(limits: Limits) -> RateLimiter {
        RateLimiter {
            limits,
            buckets: Mutex::new(HashMap::new()),
            streams: Arc::default(),
        }
    }

    /// No limits at all (benchmarks that measure the core, tests).
    pub fn unlimited() -> RateLimiter {
        let off = Rate {
            per_sec: 0,
            burst: 0,
        };
        RateLimiter::new(Limits {
            write: off,
            read: off,
            admin: off,
            unresolved: off,
        })
    }

    fn rate(&self, class: Class, key: Key) -> Rate {
        match (key, class) {
            (Key::Admin(_), _) => self.limits.admin,
            (Key::Unresolved, _) => self.limits.unresolved,
            (_, Class::Write) => self.limits.write,
            (_, Class::Read) => self.limits.read,
        }
    }

    /// The limits in force.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Takes `n` tokens from each key's bucket of `class`, all or none.
    #[allow(clippy::result_large_err)]
    pub fn admit(&self, class: Class, need: &[(Key, u32)]) -> Result<(), Status> {
        // One entry per key: a call's requests of one tenant draw together.
        let mut need_by_key: Vec<(Key, u32)> = Vec::with_capacity(need.len());
        for &(key, n) in need {
            match need_by_key.iter_mut().find(|(k, _)| *k == key) {
                Some((_, total)) => *total = total.saturating_add(n),
                None => need_by_key.push((key, n)),
            }
        }
        let need = &need_by_key[..];
        let now = Instant::now();
        let mut b = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if b.len() > BUCKETS_MAX {
            b.retain(|(c, k), v| {
                let r = self.rate(*c, *k);
                let refilled = v.tokens + now.duration_since(v.at).as_secs_f64() * r.per_sec as f64;
                refilled < r.burst as f64
            });
        }
        let mut wait_ms = 0f64;
        for &(key, n) in need {
            let r = self.rate(class, key);
            if r.per_sec == 0 {
                continue;
            }
            let (rate, burst) = (r.per_sec as f64, r.burst.max(1) as f64);
            let e = b.entry((class, key)).or_insert(Bucket {
                tokens: burst,
                at: now,
            });
            e.tokens = (e.tokens + now.duration_since(e.at).as_secs_f64() * rate).min(burst);
            e.at = now;
            if e.tokens < n as f64 {
                wait_ms = wait_ms.max((n as f64 - e.tokens) / rate * 1000.0);
            }
        }
        if wait_ms > 0.0 {
            return Err(exhausted("tenant rate limit", wait_ms.ceil() as u64));
        }
        for &(key, n) in need {
            if self.rate(class, key).per_sec == 0 {
                continue;
            }
            if let Some(e) = b.get_mut(&(class, key)) {
                e.tokens -= n as f64;
            }
        }
        Ok(())
    }

    /// A place for one more open stream, within each of `keys`' bounds (see
    /// [`stream_keys`]) and [`STREAMS_PER_NODE_MAX`]; all or none.
    #[allow(clippy::result_large_err)]
    pub fn open_stream(&self, keys: &[(Key, usize)]) -> Result<StreamSlot, Status> {
        let mut c = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        if c.total >= STREAMS_PER_NODE_MAX {
            return Err(exhausted("too many open streams on this node", 1_000));
        }
        if let Some((key, max)) = keys
            .iter()
            .find(|(k, max)| c.by_key.get(k).copied().unwrap_or(0) >= *max)
        {
            let what = match key {
                Key::Org(_) => format!("the org's quota of {max} open streams is in use"),
                _ => format!("at most {max} open streams per principal"),
            };
            return Err(exhausted(&what, 1_000));
        }
        c.total += 1;
        for (key, _) in keys {
            *c.by_key.entry(*key).or_insert(0) += 1;
        }
        Ok(StreamSlot {
            keys: keys.iter().map(|(k, _)| *k).collect(),
            counts: self.streams.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(per_sec: u32, burst: u32) -> RateLimiter {
        let r = Rate { per_sec, burst };
        RateLimiter::new(Limits {
            write: r,
            read: r,
            admin: Rate {
                per_sec: 0,
                burst: 0,
            },
            unresolved: r,
        })
    }

    #[test]
    fn a_tenant_over_its_burst_is_refused_and_others_are_not() {
        let l = limiter(1, 3);
        // A call's requests of one tenant draw together.
        assert!(l.admit(Class::Write, &[(Key::Org(1), 1); 4]).is_err());
        assert!(l.admit(Class::Write, &[(Key::Org(1), 3)]).is_ok());
        let e = l.admit(Class::Write, &[(Key::Org(1), 1)]).unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(e.metadata().get(RETRY_AFTER_MS).is_some());
        assert_eq!(e.metadata().get("allot-reason").unwrap(), "RATE_LIMITED");
        assert!(l.admit(Class::Write, &[(Key::Org(2), 1)]).is_ok());
        // Reads have their own bucket; admins are not limited by default.
        assert!(l.admit(Class::Read, &[(Key::Org(1), 1)]).is_ok());
        assert!(l.admit(Class::Write, &[(Key::Admin(1), 1_000)]).is_ok());
        // All or none: a call that would overdraw takes nothing.
        let l = limiter(1, 2);
        assert!(l
            .admit(Class::Write, &[(Key::Org(1), 1), (Key::Org(2), 3)])
            .is_err());
        assert!(l.admit(Class::Write, &[(Key::Org(1), 2)]).is_ok());
    }

    /// The defaults are on, and sized for the seed's load: an enterprise submitting
    /// 10,000 jobs at once fits the write burst; 10,000 running jobs, each with a job
    /// and a node heartbeat every 30 s, use a third of the sustained write rate; an
    /// agent's or a dashboard's polling fits the reads.
    #[test]
    fn the_defaults_are_on_and_fit_the_seed_load() {
        let d = Limits::default();
        assert!(d.write.burst >= 10_000, "{d:?}");
        let heartbeats_per_sec = 10_000 * 2 / 30;
        assert!(d.write.per_sec >= 3 * heartbeats_per_sec, "{d:?}");
        assert!(
            d.read.per_sec >= 100 && d.read.burst >= d.read.per_sec,
            "{d:?}"
        );
        // Unresolved callers are limited (together); admins are not, by default.
        assert!(d.unresolved.per_sec > 0 && d.unresolved.per_sec < d.write.per_sec);
        assert_eq!(d.unresolved.burst, d.unresolved.per_sec * SHORT_BURST_SECS);
        assert_eq!(d.admin.per_sec, 0);
        // Over a second of the default write rate with no burst left: refused.
        let l = RateLimiter::new(d);
        let org = Key::Org(1);
        assert!(l.admit(Class::Write, &[(org, d.write.burst)]).is_ok());
        let e = l
            .admit(Class::Write, &[(org, d.write.per_sec)])
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(l.admit(Class::Read, &[(org, d.read.burst)]).is_ok());
        assert!(l.admit(Class::Read, &[(org, d.read.per_sec)]).is_err());
        let anyone = Key::Unresolved;
        assert!(l
            .admit(Class::Read, &[(anyone, d.unresolved.burst + 1)])
            .is_err());
        assert!(l.admit(Class::Write, &[(Key::Admin(1), u32::MAX)]).is_ok());
    }

    #[test]
    fn an_org_is_one_tenant_whatever_token_it_uses() {
        use allot_statemachine::{OrgId, PrincipalId, ProjectId};
        let org = Actor::Tenant {
            org: OrgId(7),
            principal: PrincipalId(1),
        };
        let project = Actor::Project {
            org: OrgId(7),
            project: ProjectId(70),
            principal: PrincipalId(2),
        };
        assert_eq!(key_of(Some(org)), key_of(Some(project)));
        assert_eq!(key_of(None), Some(Key::Unresolved));
        assert_eq!(key_of(Some(Actor::System)), None);
    }

    #[test]
    fn streams_are_bounded_per_principal_and_org_and_released_on_drop() {
        use allot_statemachine::{NodeId, OrgId, PrincipalId, ProjectId};
        let l = limiter(0, 0);
        let agent = |n| stream_keys(Actor::Agent(NodeId(n)), None).unwrap();
        let slots: Vec<_> = (0..STREAMS_PER_PRINCIPAL_MAX)
            .map(|_| l.open_stream(&agent(1)).unwrap())
            .collect();
        assert_eq!(
            l.open_stream(&agent(1)).unwrap_err().code(),
            tonic::Code::ResourceExhausted
        );
        assert!(l.open_stream(&agent(2)).is_ok());
        drop(slots);
        assert!(l.open_stream(&agent(1)).is_ok());

        // An org's principals share its quota; each is also bounded alone.
        let project = |p| {
            stream_keys(
                Actor::Project {
                    org: OrgId(7),
                    project: ProjectId(70),
                    principal: PrincipalId(p),
                },
                Some(20),
            )
            .unwrap()
        };
        let first: Vec<_> = (0..STREAMS_PER_PRINCIPAL_MAX)
            .map(|_| l.open_stream(&project(1)).unwrap())
            .collect();
        let e = l.open_stream(&project(1)).unwrap_err();
        assert!(e.message().contains("per principal"), "{e:?}");
        let second: Vec<_> = (0..20 - STREAMS_PER_PRINCIPAL_MAX)
            .map(|_| l.open_stream(&project(2)).unwrap())
            .collect();
        let e = l.open_stream(&project(3)).unwrap_err();
        assert!(e.message().contains("org's quota"), "{e:?}");
        // Another org is not affected; a refused open took nothing.
        let other = stream_keys(
            Actor::Tenant {
                org: OrgId(8),
                principal: PrincipalId(9),
            },
            Some(1),
        )
        .unwrap();
        let one = l.open_stream(&other).unwrap();
        assert!(l.open_stream(&other).is_err());
        drop(one);
        drop(second);
        assert!(l.open_stream(&project(3)).is_ok());
        drop(first);
        assert!(l.streams.lock().unwrap().by_key.is_empty(), "all released");
    }

    /// Principal ids are per org: another org's principal of the same number, and the
    /// operator's, stream on whatever one org holds open. (Before, the per-principal
    /// bound was keyed by the number alone, node-wide: an org holding 16 streams with
    /// its principal 1 refused every other org's principal 1 and the bootstrap admin.)
    #[test]
    fn one_orgs_streams_do_not_count_against_anothers_principals() {
        use allot_statemachine::{OrgId, PrincipalId};
        let l = limiter(0, 0);
        let tenant = |org| {
            stream_keys(
                Actor::Tenant {
                    org: OrgId(org),
                    principal: PrincipalId(1),
                },
                Some(64),
            )
            .unwrap()
        };
        let held: Vec<_> = (0..STREAMS_PER_PRINCIPAL_MAX)
            .map(|_| l.open_stream(&tenant(7)).unwrap())
            .collect();
        assert!(l.open_stream(&tenant(7)).is_err(), "its own bound holds");
        l.open_stream(&tenant(8))
            .expect("another org's principal 1 is another principal");
        l.open_stream(&stream_keys(Actor::Admin(PrincipalId(1)), None).unwrap())
            .expect("the operator's principal 1 is not a tenant's");
        drop(held);
    }
}
