//! Per-tenant token buckets at the gRPC edge. A tenant (an org; an agent's node; an
//! admin principal) that sends faster than `rate` requests/s beyond a `burst` gets
//! RESOURCE_EXHAUSTED with `retry-after-ms`, before anything is proposed.

use crate::server::RETRY_AFTER_MS;
use allot_statemachine::{Actor, Request};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;
use tonic::metadata::MetadataValue;
use tonic::Status;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Key {
    Org(u64),
    Agent(u64),
    Admin(u64),
    System,
    /// A bearer token (resolved to its principal only inside apply): keyed by digest.
    Token([u8; 8]),
    Anonymous,
}

fn key_of(a: &Actor) -> Key {
    match a {
        Actor::Tenant { org, .. } | Actor::Project { org, .. } => Key::Org(org.0),
        Actor::Bearer(d) => {
            let mut k = [0; 8];
            k.copy_from_slice(&d.0[..8]);
            Key::Token(k)
        }
        Actor::Anonymous => Key::Anonymous,
        Actor::Agent(n) => Key::Agent(n.0),
        Actor::Admin(p) => Key::Admin(p.0),
        Actor::System => Key::System,
    }
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

pub struct RateLimiter {
    /// Requests per second per tenant; 0 disables the limiter.
    rate: f64,
    burst: f64,
    buckets: Mutex<HashMap<Key, Bucket>>,
}

/// Buckets kept before idle ones are dropped (bounded memory under id churn).
const BUCKETS_MAX: usize = 100_000;

impl RateLimiter {
    pub fn new(rate: u32, burst: u32) -> RateLimiter {
        RateLimiter {
            rate: rate as f64,
            burst: burst.max(1) as f64,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one token per request of the call from each tenant's bucket, all or none.
    pub fn admit(&self, requests: &[Request]) -> Result<(), Status> {
        if self.rate <= 0.0 {
            return Ok(());
        }
        let mut need: HashMap<Key, f64> = HashMap::new();
        for r in requests {
            *need.entry(key_of(&r.actor)).or_default() += 1.0;
        }
        let now = Instant::now();
        let mut b = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if b.len() > BUCKETS_MAX {
            let (rate, burst) = (self.rate, self.burst);
            b.retain(|_, v| v.tokens + now.duration_since(v.at).as_secs_f64() * rate < burst);
        }
        let mut wait_ms = 0f64;
        for (k, n) in &need {
            let e = b.entry(*k).or_insert(Bucket {
                tokens: self.burst,
                at: now,
            });
            e.tokens =
                (e.tokens + now.duration_since(e.at).as_secs_f64() * self.rate).min(self.burst);
            e.at = now;
            if e.tokens < *n {
                wait_ms = wait_ms.max((*n - e.tokens) / self.rate * 1000.0);
            }
        }
        if wait_ms > 0.0 {
            let mut s = Status::resource_exhausted("tenant rate limit");
            if let Ok(v) = MetadataValue::try_from(format!("{}", wait_ms.ceil() as u64)) {
                s.metadata_mut().insert(RETRY_AFTER_MS, v);
            }
            return Err(s);
        }
        for (k, n) in need {
            if let Some(e) = b.get_mut(&k) {
                e.tokens -= n;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use allot_statemachine::{Command, OrgId, PrincipalId};

    fn req(org: u64) -> Request {
        Request {
            actor: Actor::Tenant {
                org: OrgId(org),
                principal: PrincipalId(1),
            },
            request_id: 1,
            command: Command::Tick,
        }
    }

    #[test]
    fn a_tenant_over_its_burst_is_refused_and_others_are_not() {
        let l = RateLimiter::new(1, 3);
        assert!(l.admit(&[req(1), req(1), req(1)]).is_ok());
        let e = l.admit(&[req(1)]).unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(e.metadata().get(RETRY_AFTER_MS).is_some());
        assert!(l.admit(&[req(2)]).is_ok());
        // All or none: a call that would overdraw takes nothing.
        let l = RateLimiter::new(1, 2);
        assert!(l.admit(&[req(1), req(2), req(2), req(2)]).is_err());
        assert!(l.admit(&[req(1), req(1)]).is_ok());
    }
}
