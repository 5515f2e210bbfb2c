//! Decode and colocated workers: the continuous-batching engine thread ([`step`]) and the gRPC
//! `Decode` service ([`service`]) that admits requests, waits for their KV and streams their
//! tokens.

pub mod service;
pub mod step;

pub use service::{finish_to_wire, DecodeService};
pub use step::{spawn, spawn_with, Admission, DecodeEvent, DecodeHandle, HeldPrefix, Scheduling, Source};
