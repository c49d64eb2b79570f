//! gRPC: the generated code for proto/ (the admin API [`pb`] and the internal link
//! [`link_pb`]), the controlplane's services ([`server`], [`analytics`], [`experiments`],
//! [`link_server`]), the
//! roles admin calls need ([`require_admin`] for changes, [`require_reader`] for reads), the
//! admin API's mappings between protobuf and domain types ([`convert`]; the link's are
//! `nm_types::link`), the one mapping from controlplane errors to gRPC status ([`status`]), and
//! the client channel with its TLS ([`channel`]).

pub mod alerts;
pub mod analytics;
#[cfg(test)]
mod codegen;
pub mod convert;
pub mod experiments;
pub mod link_server;
#[cfg(test)]
mod proto_fingerprint;
pub mod server;
pub mod status;
pub mod users;

use std::time::Duration;

use nm_controlplane::{KeyInfo, Keys};
use nm_types::access::Role;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Request, Status};

use crate::config::ClientTls;

/// Code generated from `proto/nm/v1/*.proto` (committed, `generated/`; the test `codegen` keeps
/// it current): the public admin API.
pub mod pb {
    #![allow(
        clippy::allow_attributes_without_reason,
        reason = "tonic-generated code"
    )]
    include!("generated/nm.v1.rs");
}

/// The internal link `proto/nm/link/v1/link.proto`: its messages (nm-types' `link` module,
/// shared with the dataplane's spool) and the tonic client and server generated here over them.
pub mod link_pb {
    #![allow(
        clippy::allow_attributes_without_reason,
        reason = "tonic-generated code"
    )]
    pub use nm_types::link::pb::*;
    include!("generated/nm.link.v1.rs");
}

/// Encoded file descriptor set of proto/, for server reflection (committed beside the code).
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!("generated/nm_descriptor.bin");

/// Metadata key carrying a service key on admin calls.
pub const NM_KEY_METADATA: &str = "nm-key";
/// Metadata key carrying the link secret on link calls.
pub const LINK_SECRET_METADATA: &str = "nm-link-secret";
/// Metadata on every error `RecordSignal` answers: the signal was not stored. Without it (a
/// connection lost mid-call) a dataplane cannot know, and says so.
pub const NOT_STORED_METADATA: &str = "nm-not-stored";
/// Largest message either side of the link sends or accepts, set explicitly on both: record
/// batches are cut well below it (see `nm_dataplane::link::shipper::MAX_BATCH_BYTES`).
pub const MAX_LINK_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

/// A lazily connected channel to the controlplane (reconnects by itself), over TLS for an
/// `https://` URL: trusting `tls.ca_pem` (else the web PKI roots) and presenting
/// `tls.identity` when set (mTLS).
pub fn channel(url: &str, tls: &ClientTls) -> anyhow::Result<Channel> {
    let mut endpoint = Endpoint::from_shared(url.to_owned())?
        .connect_timeout(Duration::from_secs(2))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true);
    if url.starts_with("https://") {
        let mut config = ClientTlsConfig::new();
        config = match &tls.ca_pem {
            Some(ca) => config.ca_certificate(Certificate::from_pem(ca)),
            None => config.with_webpki_roots(),
        };
        if let Some((cert, key)) = &tls.identity {
            config = config.identity(Identity::from_pem(cert, key));
        }
        endpoint = endpoint.tls_config(config)?;
    }
    Ok(endpoint.connect_lazy())
}

/// The key of an admin call that changes something: an admin key, checked against the
/// in-memory key set (unknown, revoked or expired: UNAUTHENTICATED; another role:
/// PERMISSION_DENIED).
pub(crate) fn require_admin<T>(keys: &Keys, req: &Request<T>) -> Result<KeyInfo, Status> {
    let key = authenticate(keys, req)?;
    if key.role != Role::Admin {
        return Err(Status::permission_denied(format!(
            "this call needs an admin key (this key's role is {})",
            key.role
        )));
    }
    Ok(key)
}

/// The key of an admin call that only reads: an admin or a viewer key.
pub(crate) fn require_reader<T>(keys: &Keys, req: &Request<T>) -> Result<KeyInfo, Status> {
    let key = authenticate(keys, req)?;
    if !key.role.may_read_admin() {
        return Err(Status::permission_denied(format!(
            "this call needs an admin or viewer key (this key's role is {})",
            key.role
        )));
    }
    Ok(key)
}

fn authenticate<T>(keys: &Keys, req: &Request<T>) -> Result<KeyInfo, Status> {
    let secret = req
        .metadata()
        .get(NM_KEY_METADATA)
        .ok_or_else(|| {
            Status::unauthenticated(
                "missing nm-key metadata: admin calls need an admin or viewer key",
            )
        })?
        .to_str()
        .map_err(|_| Status::unauthenticated("invalid nm-key"))?;
    let key = keys
        .authenticate(secret.trim())
        .ok_or_else(|| Status::unauthenticated("invalid nm-key: unknown or revoked"))?;
    if key.is_expired(nm_controlplane::now_ms()) {
        return Err(Status::unauthenticated("expired nm-key"));
    }
    Ok(key)
}
