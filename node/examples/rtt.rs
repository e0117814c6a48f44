//! One peer call's cost by transport (DESIGN §61): a unary tonic call, one gRPC
//! bidirectional stream, and frames on a TCP connection multiplexed by id, each on
//! loopback with a client and a server runtime of two workers, one caller, a 200-byte
//! message; round-trip p50/p99 and the process's CPU per call (both ends), three rounds.
//!
//! `cargo run --release -p allot-node --example rtt`
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::{oneshot, Mutex};

fn cpu() -> f64 {
    let mut r: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut r) };
    (r.ru_utime.tv_sec as f64 + r.ru_utime.tv_usec as f64 / 1e6)
        + (r.ru_stime.tv_sec as f64 + r.ru_stime.tv_usec as f64 / 1e6)
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn report(name: &str, mut v: Vec<f64>, cpu: f64) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    println!(
        "{name}: p50 {:.1} us p99 {:.1} us mean {:.1} us cpu/rpc {:.1} us",
        v[n / 2],
        v[n * 99 / 100],
        v.iter().sum::<f64>() / n as f64,
        cpu / n as f64 * 1e6
    );
}

const N: usize = 20000;
const WARM_UP: u64 = 1000;

/// Times `N` calls of `one` after `WARM_UP` untimed ones, and reports them.
async fn measure(name: &str, mut one: impl AsyncFnMut(u64)) {
    let mut v = Vec::with_capacity(N);
    let mut c0 = 0.0;
    for i in 0..(N as u64 + WARM_UP) {
        if i == WARM_UP {
            c0 = cpu();
        }
        let t = Instant::now();
        one(i).await;
        if i >= WARM_UP {
            v.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    report(name, v, cpu() - c0);
}

/// A tonic channel to `addr`, connected.
async fn channel(addr: std::net::SocketAddr) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .tcp_nodelay(true)
        .connect()
        .await
        .unwrap()
}

/// A loopback listener on the server's runtime.
fn listen(srv: &tokio::runtime::Runtime) -> (tokio::net::TcpListener, std::net::SocketAddr) {
    let listener = srv
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    (listener, addr)
}

fn grpc() {
    let srv = rt();
    let cli = rt();
    let (listener, addr) = listen(&srv);
    srv.spawn(async move {
        let (rep, svc) = tonic_health::server::health_reporter();
        rep.set_service_status("x", tonic_health::ServingStatus::Serving)
            .await;
        let inc = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(inc)
            .await
            .unwrap();
    });
    cli.block_on(async move {
        let mut c = tonic_health::pb::health_client::HealthClient::new(channel(addr).await);
        let svc = "x".repeat(200);
        measure("grpc", async |_| {
            let _ = c
                .check(tonic_health::pb::HealthCheckRequest {
                    service: svc.clone(),
                })
                .await;
        })
        .await;
    });
}

type Waiters = Arc<std::sync::Mutex<HashMap<u64, oneshot::Sender<Vec<u8>>>>>;

/// One frame (`u32` length, `u64` id, the body); `None` at the end of the stream.
async fn read_frame(r: &mut (impl tokio::io::AsyncRead + Unpin)) -> Option<(u64, Vec<u8>)> {
    let mut h = [0u8; 12];
    r.read_exact(&mut h).await.ok()?;
    let len = u32::from_le_bytes(h[..4].try_into().unwrap()) as usize;
    let id = u64::from_le_bytes(h[4..].try_into().unwrap());
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await.ok()?;
    Some((id, body))
}

async fn write_frame(w: &Mutex<OwnedWriteHalf>, id: u64, body: &[u8]) {
    let mut buf = Vec::with_capacity(12 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(&id.to_le_bytes());
    buf.extend_from_slice(body);
    w.lock().await.write_all(&buf).await.unwrap();
}

fn raw() {
    let srv = rt();
    let cli = rt();
    let (listener, addr) = listen(&srv);
    srv.spawn(async move {
        loop {
            let (s, _) = listener.accept().await.unwrap();
            s.set_nodelay(true).unwrap();
            tokio::spawn(async move {
                let (mut r, w) = s.into_split();
                let w = Arc::new(Mutex::new(w));
                let mut r = tokio::io::BufReader::new(&mut r);
                loop {
                    let Some((id, body)) = read_frame(&mut r).await else {
                        return;
                    };
                    let w = w.clone();
                    tokio::spawn(async move {
                        write_frame(&w, id, &body[..20]).await;
                    });
                }
            });
        }
    });
    cli.block_on(async move {
        let s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.set_nodelay(true).unwrap();
        let (mut r, w) = s.into_split();
        let w = Arc::new(Mutex::new(w));
        let waiters: Waiters = Arc::default();
        let wt = waiters.clone();
        tokio::spawn(async move {
            let mut r = tokio::io::BufReader::new(&mut r);
            loop {
                let Some((id, body)) = read_frame(&mut r).await else {
                    return;
                };
                if let Some(tx) = wt.lock().unwrap().remove(&id) {
                    let _ = tx.send(body);
                }
            }
        });
        let body = vec![7u8; 200];
        measure("raw ", async |i| {
            let (tx, rx) = oneshot::channel();
            waiters.lock().unwrap().insert(i, tx);
            write_frame(&w, i, &body).await;
            rx.await.unwrap();
        })
        .await;
    });
}

#[derive(Clone)]
struct LinkSvc;
impl tonic::server::NamedService for LinkSvc {
    const NAME: &'static str = "x.Link";
}
struct Handler;
impl tonic::server::StreamingService<allot_proto::RaftMessage> for Handler {
    type Response = allot_proto::RaftMessage;
    type ResponseStream =
        tokio_stream::wrappers::ReceiverStream<Result<allot_proto::RaftMessage, tonic::Status>>;
    type Future = std::future::Ready<Result<tonic::Response<Self::ResponseStream>, tonic::Status>>;
    fn call(
        &mut self,
        req: tonic::Request<tonic::Streaming<allot_proto::RaftMessage>>,
    ) -> Self::Future {
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let mut inb = req.into_inner();
        tokio::spawn(async move {
            while let Ok(Some(m)) = inb.message().await {
                let tx = tx.clone();
                tokio::spawn(async move {
                    let _ = tx
                        .send(Ok(allot_proto::RaftMessage {
                            shard: 0,
                            payload: m.payload[..20].to_vec(),
                        }))
                        .await;
                });
            }
        });
        std::future::ready(Ok(tonic::Response::new(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }
}
impl tower_service::Service<http::Request<tonic::body::Body>> for LinkSvc {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, Self::Error>> + Send>,
    >;
    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }
    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        Box::pin(async move {
            let mut g = tonic::server::Grpc::new(tonic_prost::ProstCodec::<
                allot_proto::RaftMessage,
                allot_proto::RaftMessage,
            >::default());
            Ok(g.streaming(Handler, req).await)
        })
    }
}

fn stream() {
    let srv = rt();
    let cli = rt();
    let (listener, addr) = listen(&srv);
    srv.spawn(async move {
        let inc = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        tonic::transport::Server::builder()
            .add_service(LinkSvc)
            .serve_with_incoming(inc)
            .await
            .unwrap();
    });
    cli.block_on(async move {
        let mut g = tonic::client::Grpc::new(channel(addr).await);
        g.ready().await.unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel::<allot_proto::RaftMessage>(64);
        let resp = g
            .streaming(
                tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx)),
                http::uri::PathAndQuery::from_static("/x.Link/Link"),
                tonic_prost::ProstCodec::<allot_proto::RaftMessage, allot_proto::RaftMessage>::default(),
            )
            .await
            .unwrap();
        let mut inb = resp.into_inner();
        let waiters: Waiters = Arc::default();
        let wt = waiters.clone();
        tokio::spawn(async move {
            while let Ok(Some(m)) = inb.message().await {
                let id = u64::from_le_bytes(m.payload[..8].try_into().unwrap());
                if let Some(t) = wt.lock().unwrap().remove(&id) {
                    let _ = t.send(m.payload);
                }
            }
        });
        measure("strm", async |i| {
            let (otx, orx) = oneshot::channel();
            waiters.lock().unwrap().insert(i, otx);
            let mut body = vec![7u8; 200];
            body[..8].copy_from_slice(&i.to_le_bytes());
            let msg = allot_proto::RaftMessage {
                shard: 0,
                payload: body,
            };
            tx.send(msg).await.unwrap();
            orx.await.unwrap();
        })
        .await;
    });
}

fn main() {
    for _ in 0..3 {
        grpc();
        raw();
        stream();
    }
}
