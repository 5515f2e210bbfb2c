//! Decode and colocated workers. The engine thread ([`handle`] starts it) batches continuously
//! ([`step`]): a request's KV arrives from a prefill worker and is imported ([`import`]), or a
//! colocated prompt is prefilled in the batch; the request joins the batch with a sequence per
//! choice, forked for n > 1 ([`fork`]); each choice leaves when finished ([`finish`]). The gRPC
//! `Decode` service ([`service`]) admits requests, waits for their KV and streams their tokens;
//! it alone speaks the wire: the engine thread takes and gives Ferry's own types
//! ([`admission`]).

pub mod admission;
mod finish;
mod fork;
pub mod handle;
mod import;
pub mod service;
pub mod speculate;
mod step;

pub use admission::{Admission, DecodeEvent, FirstToken, HeldPrefix, Scheduling, Source};
pub use handle::{spawn, spawn_with, DecodeHandle};
pub use speculate::SpecConfig;
pub use service::{finish_to_wire, DecodeService};
