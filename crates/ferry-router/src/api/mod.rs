//! The client APIs. Each checks and converts its requests at the edge, once, into the
//! pipeline's [`crate::pipeline::Intake`], and answers from the events the pipeline sends.
//! - [`grpc`]: `ferry.v1.Ferry`, with [`grpc_tools`] for tools on gRPC;
//! - [`openai`]: the OpenAI-compatible HTTP API (completions, chat, responses, tokenize);
//! - [`prompt`]: a chat rendered with the model's template and its tools, for both.

pub mod grpc;
pub mod grpc_tools;
pub mod openai;
pub mod prompt;
