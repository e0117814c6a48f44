//! Helpers shared by the node's integration tests.

#![allow(dead_code)]

use std::time::Duration;
use tonic::transport::Channel;

/// A gRPC codec that sends and receives bodies as they are (no protobuf).
#[derive(Clone, Copy, Default)]
pub struct RawCodec;

impl tonic::codec::Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use bytes::BufMut;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;
    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        use bytes::Buf;
        Ok(Some(src.copy_to_bytes(src.remaining()).to_vec()))
    }
}

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }
    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

/// One unary call of `path` with `body` as its bytes.
pub async fn raw_unary(
    ch: Channel,
    path: &'static str,
    body: tonic::Request<Vec<u8>>,
) -> Result<Vec<u8>, tonic::Status> {
    let mut g = tonic::client::Grpc::new(ch).max_encoding_message_size(usize::MAX);
    g.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let path = http::uri::PathAndQuery::from_static(path);
    Ok(g.unary(body, path, RawCodec).await?.into_inner())
}

/// Opens a streaming call (server- or bidi-streaming) with one message, reads at most
/// one answer, and goes away.
pub async fn raw_streaming(
    ch: Channel,
    path: &'static str,
    body: tonic::Request<Vec<u8>>,
) -> Result<(), tonic::Status> {
    let mut g = tonic::client::Grpc::new(ch);
    g.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let path = http::uri::PathAndQuery::from_static(path);
    let req = body.map(|b| tokio_stream::iter(vec![b]));
    let mut s = g.streaming(req, path, RawCodec).await?.into_inner();
    let _ = tokio::time::timeout(Duration::from_millis(200), s.message()).await;
    Ok(())
}

/// A plain HTTP/1.0 GET (the metrics endpoint): the whole response, headers included.
/// The sum of a node's Prometheus samples whose line starts with `series` (a metric name,
/// or a name with its labels), read from its metrics endpoint at `addr`.
#[allow(dead_code)] // not every test binary that includes `common` reads metrics
pub async fn metric(addr: &str, series: &str) -> f64 {
    http_get(addr, "/metrics")
        .await
        .lines()
        .filter(|l| l.starts_with(series) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

pub async fn http_get(addr: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

/// The whole audit trail of `shard` as the node at `addr` holds it (its own replica,
/// from sequence 0, page by page), or the status it refused with (a gap).
pub async fn audit_on(
    addr: &str,
    shard: u32,
) -> Result<Vec<allot_statemachine::AuditEvent>, tonic::Status> {
    use allot_proto::api::v1 as pb;
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut c = pb::api_client::ApiClient::new(ch).max_decoding_message_size(64 << 20);
    let mut events = Vec::new();
    let mut from_seq = 0;
    loop {
        let r = c
            .audit(pb::AuditRequest {
                read: Some(pb::Read {
                    shard: Some(shard),
                    stale_ok: true,
                }),
                from_seq,
                limit: 1_000,
                ..Default::default()
            })
            .await?
            .into_inner();
        for e in &r.events {
            events.push(allot_proto::typed::audit_event_from(e).unwrap());
        }
        if r.next_seq >= r.head_seq || r.events.is_empty() {
            return Ok(events);
        }
        from_seq = r.next_seq;
    }
}

/// A backup of `shard` taken on the node at `addr` itself.
pub async fn backup_on(
    addr: &str,
    shard: u32,
) -> Result<allot_statemachine::backup::ShardBackup, tonic::Status> {
    let mut a = allot_node::local_cluster::admin(addr)
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut chunks = a
        .backup(allot_proto::ShardRequest { shard })
        .await?
        .into_inner();
    let mut bytes = Vec::new();
    while let Some(c) = chunks.message().await? {
        bytes.extend_from_slice(&c.data);
    }
    allot_statemachine::backup::ShardBackup::decode(&bytes)
        .map_err(|e| tonic::Status::data_loss(e.to_string()))
}
