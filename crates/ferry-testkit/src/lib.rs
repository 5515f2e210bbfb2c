//! Ferry's test kits, kept out of the shipped libraries: nothing a served cluster runs links this
//! crate except `ferry bench router`, which measures the router against these mocks.
//!
//! - [`mock`]: fast, scriptable mock workers (after sglang's router test mocks) and
//!   [`router_overhead`], the router's added latency over them.
//! - [`promlint`]: `promtool check metrics`'s rules in Rust, for each component's `/metrics`,
//!   and [`promlint::promtool`], the reference checker where it is installed.

pub mod mock;
pub mod promlint;

pub use mock::{MockConfig, MockStats, MockWorker, OverheadStats, mock_logprob, router_overhead};
