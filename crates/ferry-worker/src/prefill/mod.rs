//! The prefill worker: one engine thread runs queued prompts and streams each finished layer's
//! KV to the request's transfer task ([`engine_thread`]); the gRPC `Prefill` service
//! ([`service`]) checks a request, queues it, and pushes its KV over the transport
//! [`transport_choice`] picks.

pub mod engine_thread;
pub mod service;
pub mod transport_choice;

pub use engine_thread::{spawn, spawn_with, PrefillHandle, PrefillJob, PrefillOptions, DEFAULT_QUEUE_MAX};
pub use service::PrefillService;
