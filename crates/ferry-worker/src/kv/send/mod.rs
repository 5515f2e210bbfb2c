//! The prefill side of a KV transfer: a request's [`Outbound`] queue (filled by the engine
//! thread, layer by layer) driven by [`push`] over any [`KvTransport`]: gRPC streaming and the
//! framed TCP data path ([`transport`]), or a device pipe ([`pipe`]).

pub mod outbound;
pub mod pipe;
pub mod transport;

pub use outbound::{FirstChoice, Outbound};
pub use pipe::PipeTransport;
pub use transport::{push, Channels, Fallback, GrpcTransport, KvLink, KvTransport, Pushed, TcpTransport, H2_WINDOW, MAX_MESSAGE_BYTES};
