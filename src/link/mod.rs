//! The two adapters of the dataplane's link port (`nm_dataplane::link::Port`): which one a
//! process uses is the root's choice (see [`crate::app`]).
//!
//! - [`local::InProcess`]: the controlplane of the same process (`nm-gateway serve`). All four
//!   flows call the controlplane crate directly: no protobuf, no socket.
//! - [`remote::Grpc`]: a controlplane in another process (`nm-gateway dataplane`), over the
//!   `nm.link.v1.Link` service, presenting the link secret, over TLS when the URL is `https://`.
//!
//! Both stay in the root: the in-process adapter calls the controlplane crate, which the
//! dataplane crate never depends on, and the gRPC one needs tonic and the generated client,
//! kept out of the dataplane (its hot path sees no tonic type). Both only map: the dataplane's
//! side of each flow is `nm_dataplane::link`, the rules every record and signal passes are the
//! controlplane's (`nm_controlplane::link`), and the wire mapping is `nm_types::link`.

pub mod local;
pub mod remote;
