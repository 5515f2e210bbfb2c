//! The worker in its cluster: registration and heartbeats with every router ([`registration`],
//! [`routers`]), the addresses told to the routers and peers ([`advertise`]), graceful shutdown
//! ([`drain`]), `/metrics` ([`metrics`]), `/livez` and `/readyz` ([`health`]).

pub mod advertise;
pub mod drain;
pub mod health;
pub mod metrics;
pub mod registration;
pub mod routers;
