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
