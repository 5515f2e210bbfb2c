//! gRPC server reflection for one process: both protocol versions (`grpc.reflection.v1`, and
//! `v1alpha`, which Python's `grpcio-reflection`, older grpcurl, Postman and Evans still ask),
//! listing only the services that process answers (a router lists `Ferry`, `Registry` and
//! `Admin`, not the workers' services it would answer UNIMPLEMENTED).

use tonic_reflection::server::{Builder, Error, v1, v1alpha};

use crate::v1 as wire;

/// The services a router serves.
pub const ROUTER: &[&str] = &[wire::ferry_server::SERVICE_NAME, wire::registry_server::SERVICE_NAME, wire::admin_server::SERVICE_NAME];
/// The services a prefill worker serves.
pub const PREFILL: &[&str] = &[wire::prefill_server::SERVICE_NAME];
/// The services a decode (or colocated) worker serves.
pub const DECODE: &[&str] = &[wire::decode_server::SERVICE_NAME, wire::kv_transfer_server::SERVICE_NAME];

/// Reflection over Ferry's descriptors advertising `services` (only those: a named list leaves
/// out the reflection service itself, which clients find by calling it).
fn builder(services: &[&str]) -> Builder<'static> {
    services
        .iter()
        .fold(Builder::configure().register_encoded_file_descriptor_set(wire::FILE_DESCRIPTOR_SET), |b, s| b.with_service_name(*s))
}

/// The `v1` and `v1alpha` reflection services for a process serving `services`.
#[allow(clippy::type_complexity)]
pub fn services(
    services: &[&str],
) -> Result<(v1::ServerReflectionServer<impl v1::ServerReflection>, v1alpha::ServerReflectionServer<impl v1alpha::ServerReflection>), Error> {
    Ok((builder(services).build_v1()?, builder(services).build_v1alpha()?))
}
