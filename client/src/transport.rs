//! The connection layer: endpoints, channels, per-shard leader cache, retries with
//! exponential backoff and full jitter, NotLeader hints, deadlines, the shard count.
//!
//! A call is retried only on errors that say "try again" (unavailable, no leader, rate
//! limited, timed out). A mutating call's request ids are fixed before the first attempt
//! and the same encoded bytes go out on every retry, so a retry is answered from the
//! shard's idempotency table and never applies twice.

use crate::error::{Error, Result};
use allot_proto::admin_client::AdminClient;
use allot_proto::api::v1 as pb;
use allot_proto::api::v1::api_client::ApiClient;
use allot_proto::meta;
use allot_proto::typed;
use allot_proto::{StatusReply, StatusRequest};
use allot_statemachine::query::{Answer, Query};
use allot_statemachine::{Actor, Outcome, PrincipalId, Request};
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};

/// Largest message the client sends or accepts.
const MESSAGE_MAX: usize = 64 << 20;

/// A typed-API client on a channel, with the client's message bounds.
fn api_client(ch: Channel) -> ApiClient<Channel> {
    ApiClient::new(ch)
        .max_decoding_message_size(MESSAGE_MAX)
        .max_encoding_message_size(MESSAGE_MAX)
}

fn answer_of(reply: &pb::QueryReply) -> Result<Answer> {
    typed::query::answer_from(reply.answer.as_ref()).map_err(|e| Error::Decode(e.to_string()))
}

/// Settings of a [`Client`]; see [`Client::builder`].
#[derive(Clone, Debug)]
pub struct ClientBuilder {
    endpoints: Vec<String>,
    token: Option<String>,
    identity: Actor,
    timeout: Duration,
    attempt_timeout: Duration,
    retries: u32,
    backoff_base: Duration,
    backoff_max: Duration,
    connect_timeout: Duration,
    shards: Option<u32>,
    /// PEM of the CA that signs the nodes' certificates: connect over TLS.
    tls_ca: Option<Vec<u8>>,
    /// The first request id: ids are then `first, first + 1, ...` in call order.
    request_ids_from: Option<u128>,
}

impl Default for ClientBuilder {
    fn default() -> Self {
        ClientBuilder {
            endpoints: Vec::new(),
            token: None,
            identity: Actor::Admin(PrincipalId(1)),
            timeout: Duration::from_secs(30),
            attempt_timeout: Duration::from_secs(5),
            retries: 20,
            backoff_base: Duration::from_millis(20),
            backoff_max: Duration::from_secs(1),
            connect_timeout: Duration::from_millis(500),
            shards: None,
            tls_ca: None,
            request_ids_from: None,
        }
    }
}

impl ClientBuilder {
    /// The nodes to talk to (`host:port` or `http://host:port`); any node of the cluster
    /// will do: requests reaching a follower are forwarded or redirected to the leader.
    pub fn endpoints<I, S>(mut self, endpoints: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.endpoints = endpoints.into_iter().map(Into::into).collect();
        self
    }

    /// The API token, sent as `authorization: Bearer <token>` on every call.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// The identity the client's commands are issued as (admin, an org's tenant, or a
    /// node's agent). Recorded on every audit event and checked inside apply.
    pub fn identity(mut self, identity: Actor) -> Self {
        self.identity = identity;
        self
    }

    /// Overall deadline of one call, retries included (default 30 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Deadline of one attempt (default 5 s; never more than what is left of `timeout`).
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = timeout;
        self
    }

    /// Most attempts per call after the first (default 20).
    pub fn retries(mut self, retries: u32) -> Self {
        self.retries = retries;
        self
    }

    /// Backoff between attempts: full jitter over `base × 2^n`, capped at `max`.
    pub fn backoff(mut self, base: Duration, max: Duration) -> Self {
        self.backoff_base = base;
        self.backoff_max = max;
        self
    }

    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Connect over TLS, trusting the CA in `pem` (the cluster CA); endpoints may then
    /// also be written `https://host:port`.
    pub fn tls_ca(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_ca = Some(pem.into());
        self
    }

    /// The cluster's shard count, if known (otherwise asked of the cluster once).
    pub fn shards(mut self, shards: u32) -> Self {
        self.shards = Some(shards);
        self
    }

    /// Request ids `first, first + 1, ...` in the order the client's calls ask for
    /// them, instead of a random prefix and a counter: the same program run again with
    /// the same `first` resends every mutation with the id it had the first time, so a
    /// retry by hand after an unknown fate (a timeout) applies nothing twice
    /// (`allotctl --request-id`). `first` must not be zero.
    pub fn request_ids_from(mut self, first: u128) -> Self {
        self.request_ids_from = Some(first);
        self
    }

    pub fn build(self) -> Result<Client> {
        if self.endpoints.is_empty() {
            return Err(Error::Config("no endpoints".into()));
        }
        let mut endpoints = Vec::with_capacity(self.endpoints.len());
        for e in &self.endpoints {
            let e = e.trim();
            let addr = e
                .strip_prefix("http://")
                .or_else(|| e.strip_prefix("https://"))
                .unwrap_or(e)
                .trim_end_matches('/')
                .to_string();
            if addr.is_empty() || addr.contains("://") || !addr.contains(':') {
                return Err(Error::Config(format!(
                    "endpoint {e:?} is not host:port (or http://host:port)"
                )));
            }
            endpoints.push(addr);
        }
        let bearer = match &self.token {
            Some(t) => Some(MetadataValue::try_from(format!("Bearer {t}")).map_err(|_| {
                Error::Config("the token has characters not allowed in a header".into())
            })?),
            None => None,
        };
        if self.shards == Some(0) {
            return Err(Error::Config("shards must be positive".into()));
        }
        if self.request_ids_from == Some(0) {
            return Err(Error::Config("request ids must not be zero".into()));
        }
        Ok(Client {
            inner: Arc::new(Inner {
                endpoints,
                bearer,
                identity: self.identity,
                settings: self,
                channels: Mutex::default(),
                leaders: Mutex::default(),
                shards: AtomicU32::new(0),
                id_prefix: random_u64(),
                id_counter: AtomicU64::new(0),
            }),
        })
    }
}

/// A connection to an allot cluster. Cheap to clone; clones share connections, the
/// leader cache and the request-id sequence.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    endpoints: Vec<String>,
    bearer: Option<MetadataValue<tonic::metadata::Ascii>>,
    identity: Actor,
    settings: ClientBuilder,
    channels: Mutex<HashMap<String, Channel>>,
    /// Last known leader address per shard.
    leaders: Mutex<HashMap<u32, String>>,
    /// The cluster's shard count (0 until known).
    shards: AtomicU32,
    id_prefix: u64,
    id_counter: AtomicU64,
}

/// A random u64 from the standard library's per-process random hasher keys.
fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Errors worth another attempt, possibly elsewhere.
fn retryable(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable
            | tonic::Code::DeadlineExceeded
            | tonic::Code::ResourceExhausted
            | tonic::Code::Cancelled
            | tonic::Code::Aborted
            | tonic::Code::Unknown
    ) || transport_failure(s)
}

/// A stream the HTTP/2 connection broke — e.g. reset while the node shut down
/// gracefully (SIGTERM during a rolling restart) — which tonic reports as `INTERNAL`
/// "h2 protocol error: …": a failure of the transport, not the node's answer, so the
/// call is retried (with the same request id, so a command applied before the reset
/// is answered, not applied twice). The node's own `INTERNAL` answers are final.
fn transport_failure(s: &tonic::Status) -> bool {
    s.code() == tonic::Code::Internal && s.message().starts_with("h2 protocol error")
}

/// How long a refusal asks the caller to wait before trying again (`retry-after-ms`:
/// the node is busy, rate-limits the caller, or waits for something — an audit fill
/// before a membership change), if it says.
pub fn retry_after_of(s: &tonic::Status) -> Option<Duration> {
    metadata_str(s, meta::RETRY_AFTER_MS)
        .and_then(|v| v.parse().ok())
        .map(Duration::from_millis)
}

fn metadata_str<'a>(s: &'a tonic::Status, key: &str) -> Option<&'a str> {
    metadata_str_of(s.metadata(), key)
}

fn metadata_str_of<'a>(m: &'a tonic::metadata::MetadataMap, key: &str) -> Option<&'a str> {
    m.get(key).and_then(|v| v.to_str().ok())
}

impl Client {
    pub fn builder() -> ClientBuilder {
        ClientBuilder::default()
    }

    /// The identity this client's commands are issued as.
    pub fn identity(&self) -> Actor {
        self.inner.identity
    }

    /// The deadline of one attempt.
    /// The deadline of a whole call, retries included.
    pub fn timeout(&self) -> Duration {
        self.inner.settings.timeout
    }

    pub fn attempt_timeout(&self) -> Duration {
        self.inner.settings.attempt_timeout
    }

    pub fn endpoints(&self) -> &[String] {
        &self.inner.endpoints
    }

    /// A new request id: 64 random bits for this client, then a counter. Generate one
    /// per logical operation and reuse it on every retry of that operation.
    pub fn next_request_id(&self) -> u128 {
        let n = self.inner.id_counter.fetch_add(1, Ordering::Relaxed);
        match self.inner.settings.request_ids_from {
            Some(first) => first.wrapping_add(u128::from(n)),
            None => (u128::from(self.inner.id_prefix) << 64) | u128::from(n + 1),
        }
    }

    /// A client with the same settings and its own connections and request ids.
    pub fn fresh(&self) -> Client {
        let mut b = self.inner.settings.clone();
        b.request_ids_from = None;
        b.shards = match self.inner.shards.load(Ordering::Relaxed) {
            0 => b.shards,
            n => Some(n),
        };
        b.build().expect("settings were valid when first built")
    }

    /// The same settings without a token (for `bootstrap`, the one anonymous call).
    pub fn anonymous(&self) -> Client {
        let mut b = self.inner.settings.clone();
        b.token = None;
        b.shards = match self.inner.shards.load(Ordering::Relaxed) {
            0 => b.shards,
            n => Some(n),
        };
        b.build().expect("settings were valid when first built")
    }

    fn channel(&self, addr: &str) -> Result<Channel> {
        let mut m = lock(&self.inner.channels);
        if let Some(c) = m.get(addr) {
            return Ok(c.clone());
        }
        let bad = |e: tonic::transport::Error| Error::Config(format!("endpoint {addr}: {e}"));
        let c = match &self.inner.settings.tls_ca {
            Some(ca) => Endpoint::from_shared(format!("https://{addr}"))
                .map_err(bad)?
                .tls_config(
                    tonic::transport::ClientTlsConfig::new()
                        .ca_certificate(tonic::transport::Certificate::from_pem(ca)),
                )
                .map_err(bad)?,
            None => Endpoint::from_shared(format!("http://{addr}")).map_err(bad)?,
        };
        let c = c
            .connect_timeout(self.inner.settings.connect_timeout)
            .tcp_nodelay(true)
            .connect_lazy();
        m.insert(addr.to_string(), c.clone());
        Ok(c)
    }

    /// A request carrying the token (streams: no deadline).
    pub(crate) fn authorized<T>(&self, msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        if let Some(b) = &self.inner.bearer {
            r.metadata_mut().insert(meta::AUTHORIZATION, b.clone());
        }
        r
    }

    /// A request carrying the token and a deadline.
    pub(crate) fn request<T>(&self, msg: T, timeout: Duration) -> tonic::Request<T> {
        let mut r = self.authorized(msg);
        r.set_timeout(timeout);
        r
    }

    /// A client of one endpoint's typed API.
    pub fn api_at(&self, addr: &str) -> Result<ApiClient<Channel>> {
        Ok(api_client(self.channel(addr)?))
    }

    /// A raw gRPC client of one endpoint's admin service.
    pub fn admin_at(&self, addr: &str) -> Result<AdminClient<Channel>> {
        Ok(AdminClient::new(self.channel(addr)?))
    }

    /// The backoff before attempt `n + 1`: full jitter over `base × 2^n`, capped.
    fn backoff(&self, n: u32, retry_after: Option<Duration>) -> Duration {
        let s = &self.inner.settings;
        let ceiling = s
            .backoff_base
            .saturating_mul(1u32 << n.min(16))
            .min(s.backoff_max);
        let jitter = random_u64() % (ceiling.as_micros() as u64).max(1);
        Duration::from_micros(jitter).max(retry_after.unwrap_or_default())
    }

    /// Runs `call` against `shard`'s leader (as far as known), following NotLeader
    /// hints, rotating through the endpoints, backing off between attempts, until it
    /// succeeds, fails for good, or the retry budget or deadline runs out.
    pub(crate) async fn with_retries<T, F, Fut>(&self, shard: u32, mut call: F) -> Result<T>
    where
        F: FnMut(Channel, Duration) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let s = &self.inner.settings;
        let started = Instant::now();
        let mut rotate = shard as usize;
        let mut attempts = 0u32;
        let mut last = String::new();
        let mut cause = None;
        loop {
            let remaining = s.timeout.saturating_sub(started.elapsed());
            if attempts > s.retries || remaining.is_zero() {
                return Err(Error::Unavailable {
                    attempts,
                    elapsed: started.elapsed(),
                    last,
                    cause,
                });
            }
            attempts += 1;
            let addr = lock(&self.inner.leaders)
                .get(&shard)
                .cloned()
                .unwrap_or_else(|| {
                    self.inner.endpoints[rotate % self.inner.endpoints.len()].clone()
                });
            let per_attempt = s.attempt_timeout.min(remaining);
            let mut retry_after = None;
            match tokio::time::timeout(per_attempt, call(self.channel(&addr)?, per_attempt)).await {
                Ok(Ok(v)) => {
                    // A replica that forwarded the call (or answered a read itself)
                    // names the leader: go there next time, not through it again. Only
                    // an address this client was given is taken from a success: the
                    // peers' own addresses may not be reachable from here, and a call
                    // that worked must not lead the next one astray.
                    let leader = metadata_str_of(v.metadata(), meta::LEADER_ADDR)
                        .filter(|h| self.inner.endpoints.iter().any(|e| e == h))
                        .map_or(addr, str::to_string);
                    lock(&self.inner.leaders).insert(shard, leader);
                    return Ok(v.into_inner());
                }
                Ok(Err(st)) if retryable(&st) => {
                    last = format!("{addr}: {:?}: {}", st.code(), st.message());
                    cause = metadata_str(&st, meta::REASON).map(str::to_string);
                    retry_after = retry_after_of(&st);
                    let hint = metadata_str(&st, meta::LEADER_ADDR).map(str::to_string);
                    let mut leaders = lock(&self.inner.leaders);
                    match hint {
                        Some(h) if h != addr => {
                            // Follow the hint at once: the leader is known.
                            leaders.insert(shard, h);
                            continue;
                        }
                        _ if st.code() == tonic::Code::ResourceExhausted => {}
                        _ => {
                            leaders.remove(&shard);
                            rotate += 1;
                        }
                    }
                }
                Ok(Err(st)) => return Err(Error::from_status(&st)),
                Err(_) => {
                    last = format!("{addr}: no answer within {per_attempt:?}");
                    cause = None;
                    lock(&self.inner.leaders).remove(&shard);
                    rotate += 1;
                }
            }
            tokio::time::sleep(self.backoff(attempts - 1, retry_after)).await;
        }
    }

    /// Executes requests on a shard (one `Execute` call of the typed API, all in one log
    /// entry when they fit) and returns their outcomes in order and the log index they
    /// were applied at. The requests' ids are the caller's: reuse them to retry.
    pub async fn execute(&self, shard: u32, requests: &[Request]) -> Result<(Vec<Outcome>, u64)> {
        let call = typed::execute_request(Some(shard), requests).ok_or_else(|| {
            let internal = requests.iter().find(|r| typed::command_to(r).is_none());
            Error::Config(format!(
                "{} is the nodes' own command, not sent by clients",
                internal.map_or("a command", |r| r.command.name())
            ))
        })?;
        let reply = self
            .with_retries(shard, |ch, t| {
                let mut c = api_client(ch);
                let msg = self.request(call.clone(), t);
                async move { c.execute(msg).await }
            })
            .await?;
        let outcomes = typed::outcomes_from(&reply, requests.len())
            .map_err(|e| Error::Unexpected(e.to_string()))?;
        Ok((outcomes, reply.log_index))
    }

    /// A query through the shard's leader: linearizable (read index), or `stale` from
    /// whichever replica answers first.
    pub async fn query_with(&self, shard: u32, q: &Query, stale: bool) -> Result<Answer> {
        Ok(self.query_timed(shard, q, stale).await?.0)
    }

    /// A query with the logical time of the state that answered it.
    pub async fn query_timed(&self, shard: u32, q: &Query, stale: bool) -> Result<(Answer, u64)> {
        let (answer, _, time) = self.query_at(shard, q, stale).await?;
        Ok((answer, time))
    }

    /// A query with the applied index and the logical time of the state that answered
    /// it.
    pub async fn query_at(&self, shard: u32, q: &Query, stale: bool) -> Result<(Answer, u64, u64)> {
        let query = typed::query::query_request(shard, stale, q);
        let reply = self
            .with_retries(shard, |ch, t| {
                let mut c = api_client(ch);
                let msg = self.request(query, t);
                async move { c.query(msg).await }
            })
            .await?;
        Ok((
            answer_of(&reply)?,
            reply.applied_index,
            reply.logical_time_ms,
        ))
    }

    /// The shard's logical time now (ms since the Unix epoch): the clock expiries,
    /// leases and budget periods run on, read through the leader. Relative times
    /// ("expires in 7 days") are added to it, not to this machine's clock.
    pub async fn logical_time_ms(&self, shard: u32) -> Result<u64> {
        Ok(self.query_timed(shard, &Query::Prices, false).await?.1)
    }

    /// A linearizable query.
    pub async fn query(&self, shard: u32, q: &Query) -> Result<Answer> {
        self.query_with(shard, q, false).await
    }

    /// A stale query answered by one given replica from its applied state (no retries).
    pub async fn query_replica(&self, addr: &str, shard: u32, q: &Query) -> Result<Answer> {
        let t = self.inner.settings.attempt_timeout;
        let msg = self.request(typed::query::query_request(shard, true, q), t);
        let reply = self
            .api_at(addr)?
            .query(msg)
            .await
            .map_err(|s| Error::from_status(&s))?
            .into_inner();
        answer_of(&reply)
    }

    /// One page of a shard's audit events (filters in `req`; its read header is set
    /// here: linearizable, so a replica still catching up never reports an old head as
    /// the chain's, DESIGN §56), each event exact.
    pub async fn audit_page(
        &self,
        shard: u32,
        req: pb::AuditRequest,
    ) -> Result<(Vec<allot_statemachine::AuditEvent>, u64, u64)> {
        let reply = self
            .with_retries(shard, |ch, t| {
                let mut c = api_client(ch);
                let msg = self.request(
                    pb::AuditRequest {
                        read: Some(pb::Read {
                            shard: Some(shard),
                            stale_ok: false,
                        }),
                        ..req
                    },
                    t,
                );
                async move { c.audit(msg).await }
            })
            .await?;
        let events = reply
            .events
            .iter()
            .map(|e| typed::audit_event_from(e).map_err(|e| Error::Decode(e.to_string())))
            .collect::<Result<Vec<_>>>()?;
        Ok((events, reply.next_seq, reply.head_seq))
    }

    /// The status of one endpoint (its node id and every shard it hosts).
    pub async fn status_of(&self, addr: &str) -> Result<StatusReply> {
        let msg = self.request(StatusRequest {}, self.inner.settings.attempt_timeout);
        self.admin_at(addr)?
            .status(msg)
            .await
            .map(|r| r.into_inner())
            .map_err(|s| Error::from_status(&s))
    }

    /// The cluster's shard count: configured, cached, or asked of the endpoints.
    pub async fn shards(&self) -> Result<u32> {
        match self.inner.shards.load(Ordering::Relaxed) {
            0 => self.refresh_shards().await,
            n => Ok(n),
        }
    }

    /// Asks the endpoints for the shard count (first that answers) and caches it.
    pub async fn refresh_shards(&self) -> Result<u32> {
        if let Some(n) = self.inner.settings.shards {
            self.inner.shards.store(n, Ordering::Relaxed);
            return Ok(n);
        }
        let started = Instant::now();
        let s = &self.inner.settings;
        let mut last = String::new();
        let (mut rounds, mut attempts) = (0u32, 0u32);
        loop {
            for addr in &self.inner.endpoints {
                attempts += 1;
                match self.status_of(addr).await {
                    Ok(st) if !st.shards.is_empty() => {
                        let n = st.shards.len() as u32;
                        self.inner.shards.store(n, Ordering::Relaxed);
                        return Ok(n);
                    }
                    Ok(_) => last = format!("{addr}: hosts no shards"),
                    // The cluster answered and refused the caller: that is the answer,
                    // not an unreachable endpoint.
                    Err(e @ (Error::Unauthenticated(_) | Error::PermissionDenied(_))) => {
                        return Err(e)
                    }
                    Err(e) => last = format!("{addr}: {e}"),
                }
            }
            // Every endpoint failed: another round after a backoff, within the same
            // retry budget and deadline as any call.
            rounds += 1;
            if rounds > s.retries || started.elapsed() >= s.timeout {
                return Err(Error::Unavailable {
                    attempts,
                    elapsed: started.elapsed(),
                    last,
                    cause: None,
                });
            }
            let pause = self.backoff(rounds - 1, None);
            tokio::time::sleep(pause.min(s.timeout.saturating_sub(started.elapsed()))).await;
        }
    }

    /// The home shard of an org (the directory: [`allot_proto::shard_of_org`]).
    pub async fn shard_of_org(&self, org: allot_statemachine::OrgId) -> Result<u32> {
        Ok(allot_proto::shard_of_org(org.0, self.shards().await?))
    }
}

#[cfg(test)]
mod tests {
    use super::retryable;
    use tonic::{Code, Status};

    #[test]
    fn a_broken_stream_is_retried_and_a_nodes_internal_error_is_not() {
        assert!(retryable(&Status::new(
            Code::Internal,
            "h2 protocol error: http2 error"
        )));
        assert!(retryable(&Status::unavailable("not leader")));
        assert!(!retryable(&Status::internal("audit store: corrupt row")));
        assert!(!retryable(&Status::invalid_argument(
            "request 0: amount zero"
        )));
    }
}
