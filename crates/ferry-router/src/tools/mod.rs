//! Tool calling, pure (no I/O), for every API that offers tools (HTTP chat completions and
//! responses, gRPC `Generate`):
//! - what a request offers and asks ([`Asked`]: its functions and `tool_choice`);
//! - the format the model writes its calls in ([`format::Format`]): the one its chat template
//!   teaches, or, for a model whose template takes no tools, Ferry's generic format, in which Ferry
//!   describes the tools in the prompt itself ([`generic`]) and a grammar keeps the answer to a
//!   reply or calls;
//! - the grammar that enforces a choice ([`grammar`]);
//! - the scanner that reads calls out of the answer as it arrives, a call's arguments streamed
//!   piece by piece ([`scan`], over [`object`] and [`json`]), and the ids the calls are answered
//!   under ([`calls`]).

pub mod asked;
pub mod calls;
pub mod format;
pub mod generic;
pub mod grammar;
pub mod json;
pub mod llama;
pub mod mistral;
pub mod object;
pub mod pythonic;
pub mod read;
pub mod scan;

pub use asked::{Asked, Choice, Tool};
