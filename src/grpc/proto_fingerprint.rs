// The fingerprint of proto/'s .proto files the committed generated code was made from
// (src/grpc/generated/proto.fingerprint). One definition for two users: build.rs `include!`s this
// file (so no inner attributes or `//!` comments here) to fail a build whose proto/ changed
// since, and the codegen test (`grpc::codegen`) writes it.
//
// FNV-1a (64 bits) over each file's path under proto/ and its bytes, in path order: it guards
// against forgetting to regenerate, not against tampering, and needs no crate in build.rs.

/// `proto_dir`'s .proto files (recursively), fingerprinted: 16 hex digits.
pub(crate) fn proto_fingerprint(proto_dir: &std::path::Path) -> std::io::Result<String> {
    let mut files = Vec::new();
    let mut dirs = vec![proto_dir.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)? {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "proto") {
                files.push(path);
            }
        }
    }
    files.sort();
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for file in files {
        let name = file.strip_prefix(proto_dir).unwrap_or(&file);
        let name = name.to_string_lossy().replace('\\', "/");
        let bytes = std::fs::read(&file)?;
        for b in name.bytes().chain([0]).chain(bytes).chain([0]) {
            hash = (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    Ok(format!("{hash:016x}"))
}
