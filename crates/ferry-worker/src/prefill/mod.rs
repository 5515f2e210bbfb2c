//! The prefill worker: one engine thread runs queued prompts and streams each finished layer's
//! KV to the request's transfer task ([`engine_thread`], started by [`handle`], taking and giving
//! the types of [`admission`]); the gRPC `Prefill` service
//! ([`service`]) checks a request, queues it, and pushes its KV over the transport
//! [`transport_choice`] picks.

pub mod admission;
pub mod engine_thread;
pub mod handle;
pub mod service;
pub mod transport_choice;

pub use admission::{PrefillJob, PrefillOptions, DEFAULT_QUEUE_MAX};
pub use handle::{spawn, spawn_with, PrefillHandle};
pub use service::PrefillService;
