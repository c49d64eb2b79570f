//! The gRPC code is generated ahead of time and committed, so a build compiles no protobuf
//! compiler: the admin API's and the link's tonic code and the descriptor set for server
//! reflection in `src/grpc/generated/`, the link's messages in `types/src/link/generated/`. The
//! test `grpc::codegen` regenerates them (protox, pure Rust, no `protoc`) and fails if they
//! differ; `NM_REGENERATE_PROTO=1` makes it rewrite them.
//!
//! All this script does is refuse to build from .proto files the committed code was not made
//! from: it compares their fingerprint with the one recorded beside the code. Under
//! `NM_REGENERATE_PROTO=1` it only warns, so that the test which regenerates the code builds
//! (after a change to proto/, regenerate before using the new items in Rust code).

include!("src/grpc/proto_fingerprint.rs");

const RECORDED: &str = "src/grpc/generated/proto.fingerprint";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    println!("cargo:rerun-if-changed={RECORDED}");
    println!("cargo:rerun-if-env-changed=NM_REGENERATE_PROTO");
    let recorded = std::fs::read_to_string(RECORDED)?;
    let now = proto_fingerprint(std::path::Path::new("proto"))?;
    if recorded.trim() == now {
        return Ok(());
    }
    let stale = format!(
        "proto/ changed since the gRPC code was generated (fingerprint {now}, {RECORDED} says \
         {}): run `NM_REGENERATE_PROTO=1 cargo test --lib grpc::codegen` and commit \
         src/grpc/generated/ and types/src/link/generated/",
        recorded.trim()
    );
    if std::env::var_os("NM_REGENERATE_PROTO").is_some_and(|v| v == "1") {
        println!("cargo:warning={stale}");
        return Ok(());
    }
    Err(stale.into())
}
