//! `allot-proto`: the wire contract of allot (gRPC client, agent, admin and Raft APIs).
//!
//! Empty until the replicated node lands: the .proto files and their generated code
//! (compiled with `protox`, no system `protoc`) will live here and nowhere else.
