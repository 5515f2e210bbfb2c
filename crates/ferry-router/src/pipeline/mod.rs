//! One request's life on the cluster (the lifecycle in `proto/ferry/v1/worker.proto`), in the
//! order a request meets the stages: [`start`] (the checks both client APIs share, then a task
//! per request), [`drive`] (attempts, retries, migrations), admission on a decode worker ([`admit`]), prefill with that KV target ([`prefill`]), both
//! priced by what each prefill worker would take ([`price`]), then the decode stream relayed to the client ([`relay`]). Every call is watched ([`call`]): a deadline,
//! the client, and the death of the workers it involves end it.
//!
//! When a call fails, `ferry_core::failure::classify` decides from the status alone ([`failure`]): start again
//! elsewhere (nothing reached the client), **migrate** (tokens were streamed: the prompt plus
//! those tokens are prefilled again on other workers and the stream goes on, as Dynamo's request
//! migration does; the sampler's draws depend only on the seed and the token index, so greedy
//! and seeded requests continue exactly), wait in the admission queue ([`queue`]) for room, or end with the
//! error. Dropping a worker call (client gone, stop string, error) cancels the request on that
//! worker; in-flight counts are held by guards.
//!
//! A request with `n` choices runs as one group (one choice is a group of one): one admission
//! that reserves KV for every choice, one prefill that samples each choice's first token and
//! ships the prompt's KV once, one decode stream on which the decode worker runs the choices as
//! sequences sharing the prompt's KV blocks; each choice has its own [`request::Progress`], and every
//! delta and final names its choice. If a group's stream fails after tokens were streamed, each
//! unfinished choice continues alone as a one-choice request.

pub mod admit;
pub mod call;
pub mod drive;
pub mod failure;
pub mod prefill;
pub mod price;
pub mod queue;
pub mod relay;
pub mod request;
pub mod start;

pub use drive::run;
pub use request::Job;
pub use start::{Intake, Started, start};
