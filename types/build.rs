//! With the `link` feature: compiles `proto/nm/link/v1/link.proto` into prost messages (no
//! services: the root's build adds the tonic client and server over these types), without a
//! system `protoc` (`protox` parses the file in pure Rust).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    #[cfg(feature = "link")]
    {
        let proto = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto");
        println!("cargo:rerun-if-changed={}", proto.join("nm/link").display());
        let fds = protox::compile([proto.join("nm/link/v1/link.proto")], [&proto])?;
        tonic_prost_build::configure()
            .build_server(false)
            .build_client(false)
            .compile_fds(fds)?;
    }
    Ok(())
}
