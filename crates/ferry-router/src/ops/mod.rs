//! The operators' side: the `Registry` and `Admin` gRPC services ([`admin`]), scaling the pools
//! by hand or through Kubernetes ([`scale`]), and the SLO autoscaler ([`autoscale`]) with the
//! [`window`] of what it measures.

pub mod admin;
pub mod autoscale;
pub mod scale;
pub mod window;
