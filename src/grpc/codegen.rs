//! The committed generated code is what proto/ generates: the test here regenerates it into a
//! temporary folder, with the same generators build scripts used to run (protox, pure Rust, and
//! tonic-prost-build), and fails if a committed file differs. `NM_REGENERATE_PROTO=1 cargo test
//! --lib grpc::codegen` rewrites them instead (after a change to proto/ or to the generators'
//! versions); build.rs refuses to build from .proto files with another fingerprint.

use std::path::{Path, PathBuf};

use super::proto_fingerprint::proto_fingerprint;

/// The first lines of every generated .rs file.
const HEADER: &str = "// @generated from proto/ by the test `grpc::codegen` (src/grpc/codegen.rs): do not edit.\n\
// After a change to proto/: `NM_REGENERATE_PROTO=1 cargo test --lib grpc::codegen`.\n\n";

/// A generated file: its path from the workspace root and its bytes.
type File = (PathBuf, Vec<u8>);

/// Every generated file.
fn generate(tmp: &Path) -> Result<Vec<File>, Box<dyn std::error::Error>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let proto = root.join("proto");
    let admin = proto.join("nm/v1/admin.proto");
    let link = proto.join("nm/link/v1/link.proto");

    // The root's: the admin API, the link's tonic client and server over nm-types' messages,
    // and the descriptor set of both files (server reflection).
    let fds = protox::compile([&admin, &link], [&proto])?;
    let descriptor = prost::Message::encode_to_vec(&fds);
    let out = tmp.join("root");
    std::fs::create_dir_all(&out)?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .extern_path(".nm.link.v1", "::nm_types::link::pb")
        .out_dir(&out)
        .compile_fds(fds)?;
    let admin_rs = std::fs::read(out.join("nm.v1.rs"))?;
    let link_service_rs = std::fs::read(out.join("nm.link.v1.rs"))?;

    // nm-types' (its `link` feature): the link's messages, no services.
    let fds = protox::compile([&link], [&proto])?;
    let out = tmp.join("types");
    std::fs::create_dir_all(&out)?;
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(false)
        .out_dir(&out)
        .compile_fds(fds)?;
    let link_messages_rs = std::fs::read(out.join("nm.link.v1.rs"))?;

    let with_header = |code: Vec<u8>| [HEADER.as_bytes(), &code].concat();
    let here = PathBuf::from("src/grpc/generated");
    Ok(vec![
        (here.join("nm.v1.rs"), with_header(admin_rs)),
        (here.join("nm.link.v1.rs"), with_header(link_service_rs)),
        (here.join("nm_descriptor.bin"), descriptor),
        (
            here.join("proto.fingerprint"),
            format!("{}\n", proto_fingerprint(&proto)?).into_bytes(),
        ),
        (
            PathBuf::from("types/src/link/generated/nm.link.v1.rs"),
            with_header(link_messages_rs),
        ),
    ])
}

#[test]
fn the_committed_generated_code_is_what_proto_generates() -> Result<(), Box<dyn std::error::Error>>
{
    let tmp = tempfile::tempdir()?;
    let regenerate = std::env::var_os("NM_REGENERATE_PROTO").is_some_and(|v| v == "1");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut stale = Vec::new();
    for (path, bytes) in generate(tmp.path())? {
        let committed = root.join(&path);
        if std::fs::read(&committed).ok().as_deref() == Some(bytes.as_slice()) {
            continue;
        }
        if regenerate {
            if let Some(dir) = committed.parent() {
                std::fs::create_dir_all(dir)?;
            }
            std::fs::write(&committed, bytes)?;
        } else {
            stale.push(path.display().to_string());
        }
    }
    assert!(
        stale.is_empty(),
        "the committed generated code differs from what proto/ generates ({}): run \
         `NM_REGENERATE_PROTO=1 cargo test --lib grpc::codegen` and commit the files",
        stale.join(", ")
    );
    Ok(())
}
