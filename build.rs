//! Compiles proto/ into tonic code (the link's messages come from nm-types, which compiles
//! them once for both halves) and a file descriptor set (for server reflection) without a
//! system `protoc`: `protox` parses the .proto files in pure Rust.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = ["proto/nm/v1/admin.proto", "proto/nm/link/v1/link.proto"];
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(protos, ["proto"])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    let descriptor_path = out.join("nm_descriptor.bin");
    std::fs::write(&descriptor_path, prost::Message::encode_to_vec(&fds))?;
    // The link's messages are nm-types' (its `link` feature): only its service code is made here.
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .extern_path(".nm.link.v1", "::nm_types::link::pb")
        .compile_fds(fds)?;
    Ok(())
}
