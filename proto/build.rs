//! Compiles `proto/allot.proto` with `protox` (pure Rust; no system `protoc`) and
//! generates the tonic client and server code.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/allot.proto");
    let fds = protox::compile(["allot.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
