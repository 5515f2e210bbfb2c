//! The workers as the router knows them: the [`registry`] (leases, health, in-flight
//! accounting, and the [`prefix_index`] of which worker holds which KV blocks), how the router
//! [`dial`]s them, and which KV [`transport`] a pair is asked to use.

pub mod dial;
pub mod load;
pub mod prefix_index;
pub mod registry;
pub mod transport;

pub use dial::{DialOptions, endpoint};
pub use registry::Registry;
