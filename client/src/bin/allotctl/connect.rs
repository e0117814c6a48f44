//! The connection every command shares: the client built from the global flags, raw
//! admin calls with the same token and deadlines, and fresh ids for new objects.

use crate::args::Global;
use crate::failure::usage;
use crate::output::Format;
use allot_client::Client;
use allot_proto::admin_client::AdminClient;
use allot_statemachine::scheduler::TierConfig;
use allot_statemachine::{OrgId, Tier};
use std::hash::{BuildHasher, Hasher};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

pub struct Ctx {
    pub client: Client,
    pub format: Format,
    pub timeout: Duration,
    /// `--request-id`: new objects' default ids derive from it (see [`Ctx::new_id`]).
    request_id: Option<u128>,
    ids_taken: std::sync::atomic::AtomicU64,
}

impl Ctx {
    pub fn new(g: &Global) -> anyhow::Result<Ctx> {
        let endpoints: Vec<String> = g
            .endpoints
            .iter()
            .map(|e| e.trim().to_string())
            .filter(|e| !e.is_empty())
            .collect();
        if endpoints.is_empty() {
            return Err(usage("--endpoints: at least one host:port"));
        }
        if g.timeout.is_zero() {
            return Err(usage("--timeout must be positive"));
        }
        let mut b = Client::builder()
            .endpoints(endpoints)
            .identity(g.identity)
            .timeout(g.timeout)
            .attempt_timeout(g.timeout.min(Duration::from_secs(5)))
            .connect_timeout(g.timeout.min(Duration::from_millis(1_000)))
            .backoff(Duration::from_millis(50), Duration::from_millis(1_000))
            .retries(g.retries.unwrap_or(u32::MAX));
        if let Some(id) = g.request_id {
            b = b.request_ids_from(id);
        }
        if let Some(t) = &g.token {
            b = b.token(t.clone());
        }
        if let Some(ca) = &g.tls_ca {
            let pem =
                std::fs::read(ca).map_err(|e| usage(format!("--tls-ca {}: {e}", ca.display())))?;
            b = b.tls_ca(pem);
        }
        let client = b.build().map_err(|e| usage(e.to_string()))?;
        Ok(Ctx {
            client,
            format: g.output,
            timeout: g.timeout,
            request_id: g.request_id,
            ids_taken: Default::default(),
        })
    }

    /// The id of a new object (bucket, job, principal) the command was not given one
    /// for: fresh, or with `--request-id` derived from it, so the same command run again
    /// with the same request id names the same objects (the retry is answered, not
    /// refused as a reused request id with another payload).
    pub fn new_id(&self) -> u64 {
        let n = self
            .ids_taken
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        match self.request_id {
            Some(r) => derived_id(r, n),
            None => fresh_id(),
        }
    }

    pub fn json(&self) -> bool {
        self.format == Format::Json
    }

    /// A raw admin request with the token and the attempt deadline.
    pub fn admin_req<T>(&self, msg: T) -> tonic::Request<T> {
        self.client.grpc_request(msg)
    }

    pub fn admin(&self, addr: &str) -> anyhow::Result<AdminClient<Channel>> {
        Ok(self.client.admin_at(addr)?)
    }

    /// Runs an admin call against the endpoints in turn until one answers (retrying
    /// "unavailable" answers with a short pause) or the deadline passes.
    pub async fn admin_retry<T, F, Fut>(&self, what: &str, mut call: F) -> anyhow::Result<T>
    where
        F: FnMut(AdminClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let deadline = Instant::now() + self.timeout;
        let endpoints = self.client.endpoints().to_vec();
        let mut last = String::new();
        for attempt in 0usize.. {
            let addr = &endpoints[attempt % endpoints.len()];
            let wait = match call(self.admin(addr)?).await {
                Ok(r) => return Ok(r.into_inner()),
                Err(s) => match retry_wait(&s) {
                    Some(wait) => {
                        last = format!("{addr}: {}", s.message());
                        wait
                    }
                    None => anyhow::bail!("{what}: {addr}: {:?}: {}", s.code(), s.message()),
                },
            };
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            tokio::time::sleep(wait.min(deadline - now)).await;
        }
        anyhow::bail!(
            "{what}: no endpoint answered within {:?}: {last}",
            self.timeout
        )
    }

    pub async fn shards(&self) -> anyhow::Result<Vec<u32>> {
        Ok((0..self.client.shards().await?).collect())
    }

    /// The shards a command applies to: the one given, or every shard.
    pub async fn shards_or_all(&self, shard: Option<u32>) -> anyhow::Result<Vec<u32>> {
        let all = self.shards().await?;
        match shard {
            Some(s) if all.contains(&s) => Ok(vec![s]),
            Some(s) => Err(usage(format!(
                "--shard {s}: the cluster has shards 0..{}",
                all.len()
            ))),
            None => Ok(all),
        }
    }

    pub async fn home_shard(&self, org: OrgId) -> anyhow::Result<u32> {
        Ok(self.client.shard_of_org(org).await?)
    }

    /// The tier configuration of a shard (names for tables and `--tier <name>`).
    pub async fn tiers(&self, shard: u32) -> anyhow::Result<Vec<TierConfig>> {
        Ok(self.client.scheduler_settings(shard).await?.tiers)
    }

    /// Resolves tier names against the shard's tiers (numbers pass through).
    pub async fn resolve_tiers(
        &self,
        shard: u32,
        tiers: &[crate::values::TierArg],
    ) -> anyhow::Result<Vec<Tier>> {
        use crate::values::TierArg;
        if tiers.iter().all(|t| matches!(t, TierArg::Number(_))) {
            return Ok(tiers
                .iter()
                .filter_map(|t| match t {
                    TierArg::Number(n) => Some(Tier(*n)),
                    TierArg::Name(_) => None,
                })
                .collect());
        }
        let config = self.tiers(shard).await?;
        tiers.iter().map(|t| resolve_tier(&config, t)).collect()
    }
}

fn resolve_tier(config: &[TierConfig], t: &crate::values::TierArg) -> anyhow::Result<Tier> {
    use crate::values::TierArg;
    match t {
        TierArg::Number(n) => Ok(Tier(*n)),
        TierArg::Name(name) => config
            .iter()
            .position(|c| c.name.eq_ignore_ascii_case(name))
            .map(|i| Tier(i as u8))
            .ok_or_else(|| {
                let names: Vec<&str> = config.iter().map(|c| c.name.as_str()).collect();
                usage(format!(
                    "tier {name:?}: this shard's tiers are {} (or a number)",
                    names.join(", ")
                ))
            }),
    }
}

/// A tier's display name: `1 (paid)`.
pub fn tier_name(config: &[TierConfig], t: Tier) -> String {
    match config.get(t.0 as usize) {
        Some(c) => format!("{} ({})", t.0, c.name),
        None => t.0.to_string(),
    }
}

/// How long to wait before trying an admin call again after `s`, or `None` if `s` is
/// final: an unavailable node or shard, a deadline, or a refusal that names a wait
/// (`retry-after-ms`: a busy or rate-limiting node, a membership change waiting for an
/// audit fill) — at least 100 ms, and at least what the node asked for.
fn retry_wait(s: &tonic::Status) -> Option<Duration> {
    let after = allot_client::retry_after_of(s);
    let retryable = matches!(
        s.code(),
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown
    ) || (s.code() == tonic::Code::ResourceExhausted && after.is_some());
    retryable.then(|| after.unwrap_or_default().max(Duration::from_millis(100)))
}

/// The `n`-th object id derived from a request id: splitmix64 over its halves and `n`,
/// under 2^63 (ids above are reserved), never 0.
fn derived_id(request_id: u128, n: u64) -> u64 {
    let mut z = (request_id as u64)
        ^ ((request_id >> 64) as u64).rotate_left(32)
        ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z & (u64::MAX >> 1)).max(1)
}

/// A fresh id for a new object (bucket, job, hold) when none is given: the clock in
/// milliseconds with 20 random bits below it, under 2^63 (ids above are reserved).
pub fn fresh_id() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(crate::timefmt::now_ms());
    let random = h.finish() & 0xF_FFFF;
    ((crate::timefmt::now_ms() << 20) | random) & (u64::MAX >> 1)
}

#[cfg(test)]
mod tests {
    use super::derived_id;

    #[test]
    fn derived_ids_repeat_per_request_id_and_differ_otherwise() {
        assert_eq!(derived_id(0x77, 0), derived_id(0x77, 0));
        assert_ne!(derived_id(0x77, 0), derived_id(0x77, 1));
        assert_ne!(derived_id(0x77, 0), derived_id(0x78, 0));
        assert_ne!(derived_id(1 << 64, 0), derived_id(1, 0));
        assert!(derived_id(u128::MAX, 3) < 1 << 63);
    }
}
