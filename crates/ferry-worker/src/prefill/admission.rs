//! What the prefill engine thread takes and gives: a queued prompt ([`PrefillJob`]), the
//! commands on its channel ([`Cmd`]), the lease that holds a finished prompt's blocks until the
//! decode worker has them ([`SeqLease`]), and how the thread runs ([`PrefillOptions`]).

use crate::fault::FaultInjection;
use crate::kv::send::Outbound;
use crate::pick::Rules;
use ferry_core::SamplingParams;
use ferry_engine::Sequence;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;

pub struct PrefillJob {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub out: mpsc::UnboundedSender<Outbound>,
    pub cancelled: Arc<AtomicBool>,
    pub enqueued: Instant,
    /// Export each layer as a [`ferry_engine::KvBuffer`] (kept on the GPU for a device pipe)
    /// rather than as host bytes.
    pub buffers: bool,
    /// The prefix cache's salt (the tenant's): only blocks cached under it are attached.
    pub salt: Vec<u8>,
    /// Ship the KV of the tokens from here on (a block boundary): the decode worker holds the
    /// ones before.
    pub ship_from: usize,
    /// Set by the engine thread when the prompt starts: leading tokens served from the cache.
    pub cached: Arc<AtomicUsize>,
    /// The request's structured-output matcher (its first token is masked by it).
    pub rules: Rules,
    /// The request's span: each chunk computed for it is a `prefill_chunk` child.
    pub span: tracing::Span,
}

pub enum Cmd {
    Job(PrefillJob),
    /// A lease came back: free its sequence now (prompts may wait for those blocks).
    Release(Sequence),
}

/// Holds a finished prompt's KV blocks; dropping it (after the decode worker's acknowledgement,
/// or on any failure) hands them to the engine thread, which wakes and frees them. If the thread
/// is gone, the sequence drops here and its engine went with the thread.
pub struct SeqLease {
    pub seq: Option<Sequence>,
    pub tx: std_mpsc::Sender<Cmd>,
}

impl Drop for SeqLease {
    fn drop(&mut self) {
        if let Some(seq) = self.seq.take() {
            let _ = self.tx.send(Cmd::Release(seq));
        }
    }
}

/// The default bound of a prefill worker's queue of waiting prompts (`ferry prefill --queue-max`).
pub const DEFAULT_QUEUE_MAX: usize = 64;

/// How a prefill engine thread runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefillOptions {
    /// Most prompts waiting to start (submitted, not yet being computed); more are refused.
    pub queue_max: usize,
    pub faults: FaultInjection,
}

impl Default for PrefillOptions {
    fn default() -> Self {
        PrefillOptions { queue_max: DEFAULT_QUEUE_MAX, faults: FaultInjection::default() }
    }
}

