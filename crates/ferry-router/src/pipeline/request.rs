//! What one request carries through the pipeline: the validated [`Job`], each choice's
//! [`Progress`] across attempts, and why an attempt stopped short ([`CutShort`], [`Failed`]).

use std::time::{Duration, Instant};

use ferry_core::SamplingParams;
use ferry_core::failure::{Decision, Phase};
use ferry_proto::v1;
use tokio::sync::mpsc;
use tonic::Status;

use crate::RouterError;
use crate::pipeline::queue::Place;
use crate::state::Shared;

pub type Tx = mpsc::Sender<Result<v1::GenerateResponse, Status>>;

/// A validated request.
pub struct Job {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    /// The prefix cache's salt: the tenant's digest, then the salt the request asked for
    /// (`ferry_core::prefix_cache::cache_salt`).
    pub cache_salt: Vec<u8>,
    pub start: Instant,
}

/// Why an attempt stopped short of the end.
pub enum CutShort {
    ClientGone,
    Failed(Failed),
}

/// A failed attempt and what to do about it.
pub struct Failed {
    pub error: RouterError,
    pub decision: Decision,
}

impl From<Failed> for CutShort {
    fn from(f: Failed) -> CutShort {
        CutShort::Failed(f)
    }
}

impl Failed {
    pub fn fatal(error: RouterError) -> Failed {
        Failed { error, decision: Decision::Final }
    }
}

/// What the request (one choice of it, with `n` > 1) has done so far, across its attempts.
pub struct Progress<'a> {
    /// Which choice this is (0 unless `n` > 1): every delta and final names it.
    pub choice: u32,
    /// Its final was sent.
    pub done: bool,
    /// Detokenizer and stop strings: they run on across a migration.
    pub text: ferry_tokenizer::TextStream<'a>,
    /// Ids streamed to the client, in order.
    pub generated: Vec<u32>,
    /// Since the request started.
    pub ttft: Option<Duration>,
    pub last_token: Duration,
    pub retries: u32,
    pub migrations: u32,
    /// When the attempt that failed after tokens had been streamed failed (the start of the
    /// stall the client sees).
    pub fault_at: Option<Duration>,
    /// Time spent waiting on workers (the rest is the router's own overhead).
    pub waited: Duration,
    /// Workers that failed this request: not tried again for it.
    pub avoid: Vec<String>,
    /// The place in the admission queue, held until a decode worker admits the request.
    pub place: Option<Place>,
    /// The workers and KV transfer of the last attempt, for the summary.
    pub prefill_worker: String,
    pub decode_worker: String,
    pub kv: v1::KvTransferStats,
    /// Prompt tokens of the last attempt that a prefix cache served.
    pub cached_tokens: u32,
    /// Speculative decoding across its decode attempts: tokens proposed, and accepted.
    pub spec: (u32, u32),
    /// The prompt's logprobs reached the client: later attempts do not ask for them again.
    pub prompt_logprobs_sent: bool,
    /// Its queue time went to the metrics (at its first admission).
    pub queue_time_recorded: bool,
}

impl<'a> Progress<'a> {
    pub fn new(shared: &'a Shared, params: &SamplingParams, choice: u32) -> Progress<'a> {
        Progress {
            choice,
            done: false,
            text: ferry_tokenizer::TextStream::new(&shared.text.tokenizer, params.stop_strings.clone(), params.min_tokens),
            generated: Vec::new(),
            ttft: None,
            last_token: Duration::ZERO,
            retries: 0,
            migrations: 0,
            fault_at: None,
            waited: Duration::ZERO,
            avoid: Vec::new(),
            place: None,
            prefill_worker: String::new(),
            decode_worker: String::new(),
            kv: v1::KvTransferStats::default(),
            cached_tokens: 0,
            spec: (0, 0),
            prompt_logprobs_sent: false,
            queue_time_recorded: false,
        }
    }

    pub fn phase(&self) -> Phase {
        if self.generated.is_empty() { Phase::BeforeFirstToken } else { Phase::Streaming }
    }

    /// The prompt and parameters of the next attempt: the tokens streamed so far join the
    /// prompt, and sampling continues at their index.
    pub fn resume(&self, job: &Job) -> (Vec<u32>, SamplingParams) {
        let n = self.generated.len();
        let mut prompt = Vec::with_capacity(job.prompt.len() + n);
        prompt.extend_from_slice(&job.prompt);
        prompt.extend_from_slice(&self.generated);
        let mut params = job.params.clone();
        params.max_tokens = job.params.max_tokens.saturating_sub(n);
        params.token_offset = n as u32;
        // The prompt's logprobs are the original prompt's, sent once (a migrated request's
        // prompt holds generated tokens too; they are not recomputed).
        if n > 0 || self.prompt_logprobs_sent {
            params.prompt_logprobs = None;
        }
        (prompt, params)
    }

    /// (TTFT, TPOT in seconds) as the client saw them, `now` being the time since the request
    /// started: TTFT is `now` when no token was sent; TPOT is (last token - first) / (tokens - 1),
    /// 0 for fewer than two tokens.
    pub fn latency(&self, now: Duration) -> (Duration, f64) {
        let ttft = self.ttft.unwrap_or(now);
        let n = self.generated.len();
        let tpot = if n >= 2 { self.last_token.saturating_sub(ttft).as_secs_f64() / (n - 1) as f64 } else { 0.0 };
        (ttft, tpot)
    }

    /// Records tokens sent to the client now.
    pub fn sent(&mut self, job: &Job, ids: &[u32]) {
        if ids.is_empty() {
            return;
        }
        let now = job.start.elapsed();
        if let Some(at) = self.fault_at.take() {
            metrics::histogram!(crate::metrics::names::MIGRATION_STALL).record(now.saturating_sub(at).as_secs_f64());
        }
        let gap = self.ttft.map(|_| now.saturating_sub(self.last_token));
        crate::metrics::tokens_sent(ids.len(), gap);
        self.ttft.get_or_insert(now);
        self.last_token = now;
        self.generated.extend_from_slice(ids);
    }
}
