//! Ferry's router: the client APIs (`Ferry` over gRPC, OpenAI-compatible HTTP), the worker
//! registry with leases and health, the pairing of a prefill and a decode worker per request and
//! the request's orchestration, the operators' admin API, and Prometheus metrics. It tokenizes
//! with the model's tokenizer ([`ferry_tokenizer::ModelText`]) but never loads weights or links
//! the engine.
//!
//! The crate reads top to bottom as a request meets it (docs/architecture.md, "The router"):
//! - [`server`]: the process, every listener wired together;
//! - [`api`]: the client APIs, gRPC ([`api::grpc`]) and HTTP ([`api::openai`]), where a request
//!   is checked and converted, once, into the pipeline's [`pipeline::Intake`];
//! - [`pipeline`]: one request's life: start, attempts, admission, prefill, relay;
//! - [`workers`]: the registry (leases, in-flight accounting, the prefix index), dialing,
//!   the KV transport policy;
//! - [`ops`]: the operators' side: `Registry` and `Admin` services, scaling, the autoscaler;
//! - at the bottom, [`state`] (what the services share), [`config`], [`tools`] (tool calls,
//!   pure), [`auth`], [`metrics`], [`wire`] and the error type.
//!
//! Mock workers for its tests and `ferry bench router` are in `ferry-testkit`, not here.

pub mod api;
pub mod auth;
pub mod config;
mod error;
pub mod metrics;
pub mod ops;
pub mod pipeline;
pub mod server;
pub mod state;
pub mod tools;
pub mod wire;
pub mod workers;

pub use auth::{AdminToken, ApiKeys};
pub use config::{DEFAULT_LOCAL_PREFILL_MAX, PrefixRouting, RouterConfig};
pub use error::{RouterError, http_status_of};
pub use ops::scale::{KubeScale, Scaler};
pub use server::{Listeners, serve};
