//! The OpenAI-compatible HTTP API on the router: `POST /v1/completions`,
//! `POST /v1/chat/completions`, `POST /v1/responses` ([`responses`]), `GET /v1/models` and `GET /v1/models/{id}` (axum, HTTP/1.1), and
//! beside them, as vLLM serves them, `POST /tokenize` and `POST /detokenize` ([`tokenize`]),
//! `GET /health` and `GET /metrics`.
//!
//! API keys guard `/v1/*` and the tokenizer endpoints. `/health` and `/metrics` stay open, as in
//! vLLM: probes and Prometheus scrape them without a key, and they say nothing of any request
//! (the worker counts and the same metrics the metrics listener serves).
//!
//! Each request is parsed ([`request`]) into Ferry's `GenerateRequest` (a chat's prompt rendered
//! with its tools, [`chat`]) and started through [`grpc::generate`], the same path as the gRPC
//! `Generate`; its events become one JSON answer or server-sent events ([`response`]), with tool
//! calls scanned out of the text ([`tools`]). A client that goes away drops the event receiver, which
//! cancels the request on its workers. Errors answer in OpenAI's JSON shape ([`error`]).

pub mod body;
pub mod chat;
pub mod error;
pub mod fields;
pub mod generate;
pub mod logprobs_json;
pub mod messages;
pub mod request;
pub mod response;
pub mod responses;
pub mod server;
pub mod strict;
pub mod structured;
pub mod tokenize;
pub mod tools;

pub use server::{router, serve};
