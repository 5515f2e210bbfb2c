//! Ferry's wire contract: the code generated from `proto/ferry/v1/*.proto` (client, worker, KV
//! transfer and admin APIs), the conversions between wire messages and `ferry-core` types, and
//! what every client and server of those APIs shares: bearer tokens ([`Bearer`]), the cluster
//! secret ([`cluster`]), TLS ([`tls`]), connection limits ([`conn`]), the rule for
//! client-supplied request ids ([`request_id`]) and the loop that keeps a worker registered with
//! a router ([`heartbeat`]).

pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("ferry.v1");

    /// Encoded file descriptors, for gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("ferry_descriptor");
}

mod bearer;
pub mod cluster;
pub mod conn;
pub mod heartbeat;
pub mod metrics;
pub mod reflection;
mod convert;
pub mod request_id;
pub mod tls;
pub mod trace;

pub use bearer::{Bearer, InvalidToken, bearer_token, ct_eq};
pub use cluster::ClusterSecret;
pub use convert::*;

/// The shortest `DecodeRequest.transfer_token` a decode worker accepts. The router mints 32 hex
/// characters (128 random bits) per request.
pub const MIN_TRANSFER_TOKEN_LEN: usize = 16;
