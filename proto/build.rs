//! Compiles `proto/allot.proto` with `protox` (pure Rust; no system `protoc`) and
//! generates the tonic client and server code.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/allot.proto");
    println!("cargo:rerun-if-changed=proto/allot_api.proto");
    let fds = protox::compile(["allot.proto", "allot_api.proto"], ["proto"])?;
    // The descriptors, for gRPC server reflection (grpcurl, Postman, evans).
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out.join("allot_descriptor.bin"),
        prost::Message::encode_to_vec(&fds),
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
