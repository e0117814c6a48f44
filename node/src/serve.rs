//! Running a node: the gRPC listener (typed API, admin, Raft, health, reflection) and the
//! Prometheus listener, until a shutdown signal.

use crate::admission::Budget;
use crate::connections::{Connections, Counted};
use crate::limits::{
    CLIENT_BYTES_IN_FLIGHT_MAX, CLIENT_MESSAGE_MAX, CONCURRENT_STREAMS_PER_CONNECTION_MAX,
    CONNECTION_WINDOW_BYTES, HEADER_LIST_BYTES_MAX, RAFT_BYTES_IN_FLIGHT_MAX, RAFT_MESSAGE_MAX,
    REFLECTION_MESSAGE_MAX, REFLECTION_STREAMS_MAX, REPLY_MESSAGE_MAX, STREAM_WINDOW_BYTES,
};
use crate::node::Node;
use crate::ratelimit::RateLimiter;
use crate::server::Services;
use allot_proto::admin_server::AdminServer;
use allot_proto::api::v1::api_server::ApiServer;
use allot_proto::raft_server::RaftServer;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// Serves `node` on `listen` (gRPC) and `metrics` (HTTP `/metrics`) until `shutdown`
/// resolves; then stops the shards' Raft and syncs the WAL. At most `max_connections`
/// connections are open at once (`crate::connections`: at the bound a newcomer may take
/// another connection's slot).
pub async fn serve(
    node: Arc<Node>,
    listener: tokio::net::TcpListener,
    metrics: Option<tokio::net::TcpListener>,
    limiter: RateLimiter,
    max_connections: usize,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let services = Services {
        node: node.clone(),
        limiter: Arc::new(limiter),
    };
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_serving::<AdminServer<Services>>().await;
    reporter.set_serving::<ApiServer<Services>>().await;
    // Server reflection: grpcurl and other generic clients list and call the services
    // from the node itself.
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(allot_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?
        .max_decoding_message_size(REFLECTION_MESSAGE_MAX);
    let reflection_alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(allot_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?
        .max_decoding_message_size(REFLECTION_MESSAGE_MAX);
    if let Some(m) = metrics {
        let node = node.clone();
        tokio::spawn(async move {
            let app = axum::Router::new().route(
                "/metrics",
                axum::routing::get(move || {
                    let node = node.clone();
                    async move { refresh_and_encode(&node) }
                }),
            );
            if let Err(e) = axum::serve(m, app).await {
                tracing::error!(error = %e, "metrics listener failed");
            }
        });
    }
    // The builder's `tcp_nodelay` applies only to listeners tonic binds itself; without
    // it here, Nagle + delayed ACKs add ~40 ms stalls to small replies.
    let incoming = tonic::transport::server::TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(Duration::from_secs(30)));
    let refusals = node.metrics.refusals.clone();
    let connections = Connections::new(max_connections).counted(refusals.clone());
    let _ = node.connections.set(connections.clone());
    let throttle = Arc::new(crate::metrics::Throttle::default());
    let admitting = connections.clone();
    let incoming = futures::StreamExt::filter_map(incoming, move |accepted| {
        let admitted = match accepted.map(|io| {
            let addrs = (io.local_addr().ok(), io.peer_addr().ok());
            admitting.admit(io, addrs)
        }) {
            Ok(admitted) => match admitted {
                Some(io) => Some(Ok(io)),
                None => {
                    if throttle.due() {
                        tracing::warn!(
                            max = max_connections,
                            "connection refused: every connection slot is held by an \
                             authenticated connection with a call open"
                        );
                    }
                    None
                }
            },
            Err(e) => Some(Err(e)),
        };
        std::future::ready(admitted)
    });
    // Message bytes being read or handled: one budget for client calls, one for Raft.
    // Each call marks its connection's slot open while it is handled. A Raft call has
    // passed the peer check before it reaches its budget (when peers authenticate at
    // all: otherwise anyone may call Raft, and it proves nothing); a client call
    // vouches for its connection when the edge resolves its token
    // (`crate::connections`).
    let client = Budget::new("admission", CLIENT_BYTES_IN_FLIGHT_MAX)
        .counted(refusals.clone())
        .tracking(connections.clone(), false);
    let peers = Budget::new("admission:raft", RAFT_BYTES_IN_FLIGHT_MAX)
        .counted(refusals)
        .tracking(connections.clone(), node.peer_auth.configured());
    // With the peer link, each connection's first bytes (plaintext) or its negotiated
    // protocol (TLS) say whether it is a link or a gRPC connection (`crate::link`); links
    // end when the node stops serving.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let shutdown = async move {
        shutdown.await;
        let _ = stop.send(true);
    };
    let link = node.peer_link.then(|| crate::link::Served {
        services: services.clone(),
        auth: node.peer_auth.clone(),
        budget: peers.clone(),
        stop: stopped.clone(),
        connections: node.metrics.peer_link_connections.clone(),
    });
    let builder = tonic::transport::Server::builder();
    // The internal Raft service authenticates its caller from the request's headers,
    // before the body is read (`crate::peer`).
    let peer_auth = node.peer_auth.clone();
    let raft = tonic::service::interceptor::InterceptedService::new(
        peers.admit(
            RaftServer::new(services.clone())
                .max_decoding_message_size(RAFT_MESSAGE_MAX)
                .max_encoding_message_size(RAFT_MESSAGE_MAX),
            RAFT_MESSAGE_MAX,
        ),
        move |r| peer_auth.intercept(r),
    );
    // Health and reflection take tonic's default message bound; admission holds them to
    // the client bound.
    let router = builder
        .timeout(Duration::from_secs(30))
        .tcp_nodelay(true)
        .max_concurrent_streams(CONCURRENT_STREAMS_PER_CONNECTION_MAX)
        .http2_max_header_list_size(HEADER_LIST_BYTES_MAX)
        .http2_max_pending_accept_reset_streams(Some(64))
        .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
        .initial_stream_window_size(STREAM_WINDOW_BYTES)
        .add_service(client.admit(health, CLIENT_MESSAGE_MAX))
        .add_service(client.admit_streams(
            reflection,
            REFLECTION_MESSAGE_MAX,
            REFLECTION_STREAMS_MAX,
        ))
        .add_service(client.admit_streams(
            reflection_alpha,
            REFLECTION_MESSAGE_MAX,
            REFLECTION_STREAMS_MAX,
        ))
        .add_service(
            client.admit(
                ApiServer::new(services.clone())
                    .max_decoding_message_size(CLIENT_MESSAGE_MAX)
                    .max_encoding_message_size(REPLY_MESSAGE_MAX),
                CLIENT_MESSAGE_MAX,
            ),
        )
        .add_service(
            client.admit(
                AdminServer::new(services)
                    .max_decoding_message_size(CLIENT_MESSAGE_MAX)
                    .max_encoding_message_size(REPLY_MESSAGE_MAX),
                CLIENT_MESSAGE_MAX,
            ),
        )
        .add_service(raft);
    // Under TLS the listener is allot's own (`crate::tls`): tonic is handed the
    // sessions, whose client certificates its requests carry as with its own listener.
    let served = match (&node.tls, link) {
        (Some(tls), link) => {
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.server.clone());
            let classify = move |io: Counted<tokio::net::TcpStream>| {
                let acceptor = acceptor.clone();
                async move { accept_tls(&acceptor, io).await }
            };
            let incoming = route_connections(incoming, stopped, link, classify);
            router
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
        }
        (None, Some(link)) => {
            let classify = |io: Counted<tokio::net::TcpStream>| async move {
                match crate::link::is_link(io.get_ref()).await? {
                    true => Some(Route::Link(io, false)),
                    false => Some(Route::Grpc(io)),
                }
            };
            let incoming = route_connections(incoming, stopped, Some(link), classify);
            router
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
        }
        (None, None) => {
            router
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
        }
    };
    tracing::info!("gRPC server stopped; shutting the shards down");
    // Also when the server failed: the process must not exit under a snapshot build.
    node.shutdown().await;
    served?;
    Ok(())
}

/// Where a new connection goes.
enum Route<IO> {
    /// To the gRPC server.
    Grpc(IO),
    /// To the peer link; `true` when it is a TLS session whose client presented a
    /// certificate of the cluster CA.
    Link(IO, bool),
}

/// The TLS handshake of a new connection, bounded by `TLS_HANDSHAKE_TIMEOUT` (a
/// connection that stalls in it holds up nobody but its own task). A session that
/// negotiated the link's ALPN is a link (the listener offers it only when the node
/// serves the link); any other is gRPC. `None`: the handshake failed or timed out.
async fn accept_tls(
    acceptor: &tokio_rustls::TlsAcceptor,
    io: Counted<tokio::net::TcpStream>,
) -> Option<Route<tokio_rustls::server::TlsStream<Counted<tokio::net::TcpStream>>>> {
    let session =
        match tokio::time::timeout(crate::limits::TLS_HANDSHAKE_TIMEOUT, acceptor.accept(io)).await
        {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "TLS handshake failed");
                return None;
            }
            Err(_) => {
                tracing::debug!("TLS handshake timed out");
                return None;
            }
        };
    let conn = session.get_ref().1;
    if conn.alpn_protocol() == Some(crate::tls::ALPN_LINK) {
        let cert = conn.peer_certificates().is_some_and(|c| !c.is_empty());
        return Some(Route::Link(session, cert));
    }
    Some(Route::Grpc(session))
}

/// Serves the peer links among `incoming`'s connections and yields the others (for the
/// gRPC server), as `classify` routes them. Each connection is classified on its own
/// task, so one that is slow to send its first bytes or to finish its handshake holds
/// up nobody; `classify` bounds how long it waits.
fn route_connections<IO, C, F>(
    incoming: impl futures::Stream<Item = std::io::Result<Counted<tokio::net::TcpStream>>>
        + Send
        + 'static,
    stop: tokio::sync::watch::Receiver<bool>,
    link: Option<crate::link::Served>,
    classify: C,
) -> impl futures::Stream<Item = std::io::Result<IO>> + Send
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    C: Fn(Counted<tokio::net::TcpStream>) -> F + Send + 'static,
    F: Future<Output = Option<Route<IO>>> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        let mut incoming = std::pin::pin!(incoming);
        let mut stopping = stop.clone();
        loop {
            let next = tokio::select! {
                n = futures::StreamExt::next(&mut incoming) => n,
                _ = stopping.wait_for(|s| *s) => None,
                _ = tx.closed() => None,
            };
            let Some(accepted) = next else { return };
            let io = match accepted {
                Ok(io) => io,
                Err(e) => {
                    if tx.send(Err(e)).await.is_err() {
                        return;
                    }
                    continue;
                }
            };
            let (tx, link, mut stop) = (tx.clone(), link.clone(), stop.clone());
            let slot = io.slot().clone();
            let route = classify(io);
            tokio::spawn(async move {
                // A connection that gives its slot to another stops being classified
                // (its first-bytes wait peeks the socket, which an eviction does not end).
                let route = tokio::select! {
                    r = route => r,
                    _ = stop.wait_for(|s| *s) => None,
                    _ = slot.evicted() => None,
                };
                match (route, link) {
                    (Some(Route::Link(io, cert)), Some(link)) => {
                        crate::connections::on(Some(slot), crate::link::serve(io, link, cert)).await
                    }
                    (Some(Route::Grpc(io)), _) => {
                        let _ = tx.send(Ok(io)).await;
                    }
                    _ => {}
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// Refreshes the per-shard gauges from the shards and renders the registry.
pub fn refresh_and_encode(node: &Node) -> String {
    let m = &node.metrics;
    for s in &node.shards {
        let shard = s.id.to_string();
        let rm = s.raft.metrics().borrow().clone();
        let set = |field: &str, v: f64| m.raft.with_label_values(&[&shard, field]).set(v);
        set("term", rm.current_term as f64);
        set("leader", rm.current_leader.unwrap_or(0) as f64);
        set(
            "is_leader",
            (rm.current_leader == Some(node.id)) as u8 as f64,
        );
        set(
            "applied_index",
            rm.last_applied.map(|l| l.index).unwrap_or(0) as f64,
        );
        set("last_log_index", rm.last_log_index.unwrap_or(0) as f64);
        let g = s.view.read();
        set("logical_time_ms", g.state.time_ms as f64);
        for (tier, depth) in g.state.scheduler.queue_depth() {
            m.queue_depth
                .with_label_values(&[&shard, &tier.0.to_string()])
                .set(depth as f64);
        }
        m.gpus
            .with_label_values(&[&shard, "fleet"])
            .set(g.state.scheduler.fleet_gpus as f64);
        m.gpus
            .with_label_values(&[&shard, "used"])
            .set(g.state.scheduler.used_gpus as f64);
        let t = g.state.ledger.totals;
        // Credits reserved by open holds: every hold's path ends at its org, so the
        // orgs' usage counters add up to the shard's held total (one pass per scrape).
        let held: u128 = g
            .state
            .ledger
            .orgs
            .values()
            .map(|o| o.account.usage.held as u128)
            .sum();
        for (kind, v) in [
            ("issued", t.issued),
            ("consumed", t.consumed),
            ("expired", t.expired),
            ("held", held),
        ] {
            m.credits.with_label_values(&[&shard, kind]).set(v as f64);
        }
        set_demand(m, &shard, &g.state);
        set_state_rows(m, &shard, &g.state);
    }
    if let Some(c) = node.connections.get() {
        let (authenticated, unauthenticated, max) = c.census();
        for (state, n) in [
            ("authenticated", authenticated),
            ("unauthenticated", unauthenticated),
            ("max", max),
        ] {
            m.connections
                .with_label_values(&[state])
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }
    set_rocksdb_memory(m, &node.db);
    m.wal_sync_waiting.set(node.syncer.waiting().as_secs_f64());
    m.encode()
}

/// The tables of a shard's state that grow with traffic or with tenants, and their rows
/// (`allot_state_rows`): what memory growth is made of, read per table (DESIGN §63).
/// Each count is O(1). The rows that a shard-wide bound caps are named as the bound
/// counts them (`holds_open` against `HOLDS_OPEN_MAX`, `jobs_finished` against
/// `JOBS_FINISHED_MAX`, …); `holds` and `jobs` are every row the maps hold.
pub fn state_rows(s: &allot_statemachine::State) -> [(&'static str, usize); 13] {
    let l = &s.ledger;
    let sched = &s.scheduler;
    [
        ("idempotency_records", s.idempotency.len()),
        ("holds", l.holds.len()),
        ("holds_open", l.holds.open),
        ("holds_settled", l.holds.settled.len()),
        ("jobs", sched.jobs.len()),
        ("jobs_active", sched.active_jobs()),
        ("jobs_finished", sched.finished.len()),
        ("gpu_nodes", s.scheduler.nodes.len()),
        ("orgs", l.orgs.len()),
        ("projects", l.projects.len()),
        ("users", l.users.len()),
        ("buckets", l.buckets.len()),
        ("principals", s.security.principals.len()),
    ]
}

/// `allot_state_rows` of one shard from its replica's state.
fn set_state_rows(m: &crate::metrics::Metrics, shard: &str, state: &allot_statemachine::State) {
    for (table, rows) in state_rows(state) {
        m.state_rows
            .with_label_values(&[shard, table])
            .set(rows as f64);
    }
}

/// RocksDB's memory per column family (`allot_rocksdb_memory_bytes`): memtables
/// (active, immutable and pinned), the table readers' indexes and filters, and the
/// block cache. Each column family has its own block cache (RocksDB's default, as
/// `store::open_db` leaves it); a cache shared between them would be reported once
/// per column family, and a sum over them would count it several times.
fn set_rocksdb_memory(m: &crate::metrics::Metrics, db: &rocksdb::DB) {
    for cf in crate::store::COLUMN_FAMILIES {
        let Some(h) = db.cf_handle(cf) else { continue };
        for (kind, property) in [
            ("memtables", "rocksdb.size-all-mem-tables"),
            ("table_readers", "rocksdb.estimate-table-readers-mem"),
            ("block_cache", "rocksdb.block-cache-usage"),
        ] {
            if let Ok(Some(v)) = db.property_int_value_cf(&h, property) {
                m.rocksdb_memory_bytes
                    .with_label_values(&[cf, kind])
                    .set(v as f64);
            }
        }
    }
}

/// The demand gauges of one shard from its replica's state (one walk of the queued
/// jobs), every job taken to run to its max duration.
fn set_demand(m: &crate::metrics::Metrics, shard: &str, state: &allot_statemachine::State) {
    use allot_statemachine::query::DemandQuery;
    let rows = state.scheduler.demand(
        &state.config.scheduler,
        state.time_ms,
        DemandQuery::default(),
    );
    for r in rows {
        let t = r.gpu_type.0.as_str();
        m.demand_gpus
            .with_label_values(&[shard, t, "capacity"])
            .set(f64::from(r.capacity_gpus));
        m.demand_gpus
            .with_label_values(&[shard, t, "used"])
            .set(f64::from(r.used_gpus));
        m.demand_queued_gpu_hours
            .with_label_values(&[shard, t])
            .set(r.queued_gpu_ms as f64 / 3_600_000.0);
        m.demand_wait_seconds
            .with_label_values(&[shard, t])
            .set(r.wait_ms.map_or(f64::INFINITY, |w| w as f64 / 1_000.0));
        for tier in &r.tiers {
            m.demand_gpus_needed
                .with_label_values(&[shard, t, &tier.tier.0.to_string()])
                .set(f64::from(tier.gpus_needed));
        }
    }
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutdown signal received");
}

#[cfg(test)]
mod tests {
    use super::{set_demand, set_state_rows};
    use crate::metrics::Metrics;
    use allot_statemachine::testkit::*;
    use allot_statemachine::*;

    fn submit(h: &mut Harness, job: u64, gpus: u32) {
        let spec = JobSpec {
            max_duration_ms: HOUR_MS,
            ..Harness::job_spec(job, Tier::PAID, vec![a100()], gpus)
        };
        h.ok(Command::SubmitJob(spec));
    }

    /// The world with 1,000 credits on its project.
    fn funded() -> Harness {
        let mut h = Harness::world();
        h.grant(
            1,
            Account::Project(PROJECT),
            BucketKind::Paid,
            credits(1_000),
            None,
        );
        h
    }

    #[test]
    fn the_state_rows_count_what_the_traffic_left() {
        let mut h = funded();
        h.fleet(&[(1, a100(), 8, 80), (2, a100(), 8, 80)]);
        let rows = |h: &Harness| -> std::collections::BTreeMap<&str, usize> {
            super::state_rows(&h.state).into_iter().collect()
        };
        let before = rows(&h);
        // Ten requests of the benchmark's hold cycles: three holds settled (create,
        // capture, release), a fourth created.
        let mut cycle = workload::HoldCycle::new(7, 3_000_000);
        let outs = h.apply((0..10).map(|_| cycle.request()).collect());
        assert!(outs.iter().all(|o| o.is_ok()), "{outs:?}");
        let after = rows(&h);
        let grew = |table: &str| after[table] - before[table];
        assert_eq!(grew("idempotency_records"), 10);
        assert_eq!(grew("holds"), 4);
        assert_eq!(grew("holds_open"), 1);
        assert_eq!(grew("holds_settled"), 3);
        assert_eq!(grew("jobs"), 0);
        assert_eq!(after["jobs_active"], 0);
        assert_eq!(after["gpu_nodes"], 2);
        assert_eq!(after["orgs"], h.state.ledger.orgs.len());
        // And the gauge carries them, per shard and table.
        let m = Metrics::new();
        set_state_rows(&m, "3", &h.state);
        let text = m.encode();
        let line = format!(
            r#"allot_state_rows{{shard="3",table="idempotency_records"}} {}"#,
            after["idempotency_records"]
        );
        assert!(text.contains(&line), "no {line} in {text}");
    }

    #[test]
    fn the_demand_gauges_follow_the_replicas_state() {
        let mut h = funded();
        h.fleet(&[(1, a100(), 8, 80)]);
        submit(&mut h, 10, 8);
        submit(&mut h, 11, 4);
        let m = Metrics::new();
        set_demand(&m, "0", &h.state);
        let text = m.encode();
        for line in [
            r#"allot_demand_gpus{gpu_type="A100",kind="capacity",shard="0"} 8"#,
            r#"allot_demand_gpus{gpu_type="A100",kind="used",shard="0"} 8"#,
            r#"allot_demand_queued_gpu_hours{gpu_type="A100",shard="0"} 4"#,
            // 4 GPU-hours on 8 GPUs.
            r#"allot_demand_wait_seconds{gpu_type="A100",shard="0"} 1800"#,
            // Within 10 minutes: 24 GPUs, 8 there.
            r#"allot_demand_gpus_needed{gpu_type="A100",shard="0",tier="1"} 16"#,
            r#"allot_demand_gpus_needed{gpu_type="A100",shard="0",tier="0"} 0"#,
        ] {
            assert!(text.contains(line), "no {line} in {text}");
        }
        // The node drains: no capacity, no finite wait.
        h.ok(Command::SetNodeDraining {
            node: NodeId(1),
            draining: true,
        });
        set_demand(&m, "0", &h.state);
        let text = m.encode();
        for line in [
            r#"allot_demand_gpus{gpu_type="A100",kind="capacity",shard="0"} 0"#,
            // Infinity (the encoder writes `inf`, which Prometheus parses as +Inf).
            r#"allot_demand_wait_seconds{gpu_type="A100",shard="0"} inf"#,
            r#"allot_demand_gpus_needed{gpu_type="A100",shard="0",tier="1"} 24"#,
        ] {
            assert!(text.contains(line), "no {line} in {text}");
        }
    }
}
