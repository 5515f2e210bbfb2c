//! The decode side of a KV transfer. Every link a transfer arrives on (the gRPC stream,
//! [`grpc`]; the TCP data path, [`tcp`]; a device pipe, [`pipe`]) is a thin driver ([`drive`])
//! of one pure state machine ([`inbound`]), which validates and assembles the chunks
//! ([`assembler`]) of a transfer the decode service admitted ([`transfers`]).

pub mod assembler;
mod drive;
pub mod frame_event;
pub mod grpc;
pub mod inbound;
pub mod pipe;
pub mod tcp;
pub mod transfers;

pub use grpc::KvTransferService;
pub use tcp::serve_tcp;
pub use transfers::{Delivery, KvReceiver, Ticket};
