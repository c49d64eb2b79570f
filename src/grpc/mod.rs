//! gRPC: the generated code for proto/, the controlplane's services ([`server`]), the
//! dataplane's link to its controlplane ([`link`], with the record [`shipper`]), and the one mapping from controlplane errors
//! to gRPC status ([`status`]).

pub mod analytics;
pub mod convert;
pub mod link;
pub mod server;
pub mod shipper;
pub mod status;

/// Code generated from `proto/nm/v1/*.proto` by build.rs.
pub mod pb {
    #![allow(
        clippy::allow_attributes_without_reason,
        reason = "tonic-generated code"
    )]
    tonic::include_proto!("nm.v1");
}

/// Encoded file descriptor set of proto/, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("nm_descriptor");

/// Metadata key carrying a service key on admin calls.
pub const NM_KEY_METADATA: &str = "nm-key";
