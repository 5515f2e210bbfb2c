//! Moving one request's KV from a prefill worker to a decode worker, by side: [`send`] (the
//! prefill worker's transports) and [`receive`] (the decode worker's), with what both use: how
//! the bytes are cut ([`chunks`]), the frame format of the TCP data path and device pipes
//! ([`frame`]), the device pipe's contract ([`device`]) and the receiver's reply ([`replies`]).
//!
//! The prefill engine thread exports each layer as soon as the forward pass has computed it
//! (DistServe arXiv:2401.09670 §4 and Splitwise arXiv:2311.18677 §4.3 overlap the transfer with
//! prefill the same way) and hands it to a transfer task as an [`send::Outbound`] message. The
//! task cuts it into checksummed chunks and sends them over a [`send::KvTransport`]; the decode
//! side's [`receive::KvReceiver`] validates and assembles them into one payload
//! (`ferry_core::KvPayloadHeader` + body), whatever transport carried them: every transport is a
//! thin driver of one pure state machine ([`receive::inbound`]), and TCP and the device pipes
//! share one frame format ([`frame`]).
//!
//! A prefill worker with device pipes (NCCL) exports each layer as a [`ferry_engine::KvBuffer`]
//! instead ([`send::Outbound::Buffer`]): on a GPU the layer stays in the gather buffer on the
//! device, and the pipe sends it device to device into a payload body the decode worker
//! allocated on its own device, which its engine then scatters from. A host transport (the
//! fallback) copies the buffer out and sends it like any other layer.

pub mod chunks;
pub mod device;
pub mod frame;
#[cfg(any(test, feature = "testing"))]
pub mod in_process;
pub mod receive;
pub mod replies;
pub mod send;

pub use chunks::{chunk_ranges, DEFAULT_STALL, MAX_CHUNK_BYTES};
pub use send::Outbound;
