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
    // Messages alone (prost), and the services on top of them (tonic) in a
    // file of their own: crates that only need the messages (the
    // controller's core) build without tonic (feature `grpc` off).
    let msgs = out.join("msgs");
    let svc = out.join("svc");
    std::fs::create_dir_all(&msgs)?;
    std::fs::create_dir_all(&svc)?;
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(false)
        .out_dir(&msgs)
        .compile_fds(fds.clone())?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .extern_path(".weft.v1", "crate::v1")
        .codec_path("crate::codec::Codec")
        .out_dir(&svc)
        .compile_fds(fds)?;
    Ok(())
}
