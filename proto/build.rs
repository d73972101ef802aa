//! Compiles `weft/v1/*.proto` with protox (pure Rust), so building weft never
//! needs a system `protoc`. The encoded descriptor set is kept for gRPC server
//! reflection.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "weft/v1/types.proto",
        "weft/v1/desired.proto",
        "weft/v1/admin.proto",
        "weft/v1/agent.proto",
        "weft/v1/federation.proto",
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["."])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("weft_descriptor.bin"), prost::Message::encode_to_vec(&fds))?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    Ok(())
}
