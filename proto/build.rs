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
    // The last release's API (`compat`: what a change must stay
    // compatible with), from the copy of its files kept in `baseline/`.
    println!("cargo:rerun-if-changed=baseline");
    let baseline = protox::compile(files, ["baseline"])?;
    std::fs::write(
        out.join("baseline_descriptor.bin"),
        prost::Message::encode_to_vec(&baseline),
    )?;
    // Messages alone (prost), and the services on top of them (tonic) in a
    // file of their own: crates that only need the messages (the
    // controller's core) build without tonic (feature `grpc` off).
    //
    // Clients and servers are generated apart: the servers send
    // `WatchResponse` as `crate::wire::WatchResponse`, which encodes to the
    // same bytes but may be assembled from objects encoded once for every
    // agent that gets them; clients decode the plain message.
    let msgs = out.join("msgs");
    let clients = out.join("clients");
    let servers = out.join("servers");
    for d in [&msgs, &clients, &servers] {
        std::fs::create_dir_all(d)?;
    }
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(false)
        .out_dir(&msgs)
        .compile_fds(fds.clone())?;
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .extern_path(".weft.v1", "crate::v1")
        .codec_path("crate::codec::Codec")
        .out_dir(&clients)
        .compile_fds(fds.clone())?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(false)
        .extern_path(".weft.v1", "crate::v1")
        .extern_path(".weft.v1.WatchResponse", "crate::wire::WatchResponse")
        .codec_path("crate::codec::Codec")
        .out_dir(&servers)
        .compile_fds(fds)?;
    Ok(())
}
