//! The prefill worker: one engine thread runs queued prompts in batches up to a token budget,
//! streams each finished layer's KV to the request's transfer task, samples the first token, and
//! keeps the sequence's blocks under a lease until the decode worker has acknowledged them.
//!
//! The queue of prompts waiting to start is bounded ([`PrefillOptions::queue_max`]): beyond it a
//! request is refused at once, RESOURCE_EXHAUSTED tagged `overloaded`, so the router tries
//! another worker or waits instead of piling prompts here. A step that fails for one prompt fails
//! that prompt alone ([`crate::isolate`]); a panic or a device fault fails them all and takes the
//! worker out ([`crate::fault`]).

use crate::error::{Result, WorkerError};
use crate::facts::ModelFacts;
use crate::fault::{panic_message, EngineFault, FaultInjection};
use crate::isolate::{sequence_error, step_isolating};
use crate::kv::send::{FirstChoice, Outbound};
use crate::load::LoadGauge;
use crate::logprobs;
use crate::pick::{first_tokens, First, Rules};
use crate::role::Role;
use bytes::Bytes;
use ferry_core::schedule::{admit_prompt, plan_prefill, Admit, PromptLeft};
use ferry_core::{BlockTable, SamplingParams, TokenLogprob};
use ferry_engine::{Engine, EngineError, SeqId, Sequence, StepItem};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
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
}

enum Cmd {
    Job(PrefillJob),
    /// A lease came back: free its sequence now (prompts may wait for those blocks).
    Release(Sequence),
}

/// Holds a finished prompt's KV blocks; dropping it (after the decode worker's acknowledgement,
/// or on any failure) hands them to the engine thread, which wakes and frees them. If the thread
/// is gone, the sequence drops here and its engine went with the thread.
struct SeqLease {
    seq: Option<Sequence>,
    tx: std_mpsc::Sender<Cmd>,
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

#[derive(Clone)]
pub struct PrefillHandle {
    tx: std_mpsc::Sender<Cmd>,
    pub load: Arc<LoadGauge>,
    pub facts: ModelFacts,
    queue_max: usize,
    /// Set when the engine thread failed (see [`crate::fault`]).
    pub fault: Arc<EngineFault>,
}

impl PrefillHandle {
    /// Queue a prompt, or refuse it (tagged `overloaded`) when `queue_max` prompts already wait.
    pub fn submit(&self, job: PrefillJob) -> Result<()> {
        let max = self.queue_max as u64;
        if self.load.waiting_requests.fetch_update(Relaxed, Relaxed, |w| (w < max).then_some(w + 1)).is_err() {
            metrics::counter!("ferry_worker_refusals_total", "role" => "prefill", "reason" => "queue_full").increment(1);
            return Err(WorkerError::Exhausted(format!("the prefill queue is full: {max} prompts wait to start (--queue-max {max})")));
        }
        self.load.queued_prefill_tokens.fetch_add(job.prompt.len() as u64, Relaxed);
        self.load.queued_requests.fetch_add(1, Relaxed);
        self.tx.send(Cmd::Job(job)).map_err(|_| {
            self.load.waiting_requests.fetch_sub(1, Relaxed);
            WorkerError::ShuttingDown
        })
    }
}

struct Active {
    job: PrefillJob,
    seq: Sequence,
    done: usize,
    started: Instant,
    /// The prompt's logprobs so far, when asked for ([`crate::logprobs`]).
    prompt_logprobs: Vec<TokenLogprob>,
}

/// Start the engine thread.
pub fn spawn(engine: Engine, model: String) -> PrefillHandle {
    spawn_with(engine, model, PrefillOptions::default())
}

/// [`spawn`] with these options.
pub fn spawn_with(engine: Engine, model: String, opts: PrefillOptions) -> PrefillHandle {
    let (tx, rx) = std_mpsc::channel();
    let load = Arc::new(LoadGauge::default());
    let facts = ModelFacts::of(&engine, model);
    let fault = EngineFault::new();
    let handle = PrefillHandle { tx: tx.clone(), load: load.clone(), facts, queue_max: opts.queue_max.max(1), fault: fault.clone() };
    std::thread::Builder::new()
        .name("ferry-prefill".into())
        .spawn(move || {
            let mut thread = PrefillThread { engine, queue: VecDeque::new(), active: Vec::new(), load, faults: opts.faults, steps: 0, busy: 0.0 };
            let what = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| thread.run(&rx, &tx))) {
                Ok(Ok(())) => return,
                Ok(Err(e)) => format!("a prefill step failed at the backend: {e}"),
                Err(p) => format!("the prefill engine thread panicked: {}", panic_message(p.as_ref())),
            };
            tracing::error!("{what}: failing every request this worker holds and taking it out");
            fault.report(what.clone());
            let fail = |j: PrefillJob| {
                let _ = j.out.send(Outbound::Failed(WorkerError::EngineFailed(what.clone())));
            };
            thread.active.drain(..).for_each(|a| fail(a.job));
            thread.queue.drain(..).for_each(fail);
            while let Ok(cmd) = rx.try_recv() {
                if let Cmd::Job(j) = cmd {
                    fail(j);
                }
            }
        })
        .expect("spawn the prefill engine thread");
    handle
}

/// The prefill engine thread's state.
struct PrefillThread {
    engine: Engine,
    /// Prompts waiting to start (counted in `load.waiting_requests`).
    queue: VecDeque<PrefillJob>,
    active: Vec<Active>,
    load: Arc<LoadGauge>,
    faults: FaultInjection,
    steps: u64,
    /// Seconds the loop was busy around its steps ([`LoadGauge::publish`]).
    busy: f64,
}

impl PrefillThread {
    /// One prompt left the waiting queue.
    fn left_queue(&self) {
        let _ = self.load.waiting_requests.fetch_update(Relaxed, Relaxed, |w| Some(w.saturating_sub(1)));
    }

    /// Run until every handle is gone (Ok) or the backend fails (Err: the engine is broken).
    fn run(&mut self, rx: &std_mpsc::Receiver<Cmd>, tx: &std_mpsc::Sender<Cmd>) -> std::result::Result<(), EngineError> {
        let bs = self.engine.kv_layout().block_size;
        let budget = self.engine.max_batch_tokens();
        self.load.blocks_total.store(self.engine.total_blocks() as u64, Relaxed);
        self.load.block_size.store(bs as u64, Relaxed);
        loop {
            publish(&mut self.engine, &self.load, &self.queue, &self.active, self.busy);
            if self.queue.is_empty() && self.active.is_empty() {
                match rx.recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(_) => return Ok(()),
                }
            }
            // Busy from here to the step's end (the step ships the KV layer by layer).
            let busy = Instant::now();
            while let Ok(cmd) = rx.try_recv() {
                self.handle(cmd);
            }
            self.admit(bs);
            if self.active.is_empty() {
                if !self.queue.is_empty() {
                    // Waiting for leases to come back: block until something changes.
                    if let Ok(cmd) = rx.recv() {
                        self.handle(cmd);
                    }
                }
                continue;
            }
            self.faults.before_step(self.steps);
            self.steps += 1;
            step(&mut self.engine, &mut self.active, budget, tx, &self.load)?;
            self.busy += busy.elapsed().as_secs_f64();
        }
    }

    fn handle(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Job(j) => self.queue.push_back(j),
            Cmd::Release(seq) => {
                let id = seq.id();
                if let Err(e) = self.engine.release_now(seq) {
                    tracing::error!("releasing prefill sequence {}: {e}", id.0);
                }
            }
        }
    }

    /// Drop cancelled requests (freeing their blocks), then start queued prompts while the cache
    /// can hold them whole.
    fn admit(&mut self, bs: usize) {
        let before = self.queue.len();
        self.queue.retain(|j| !j.cancelled.load(Relaxed));
        for _ in self.queue.len()..before {
            self.left_queue();
        }
        let (engine, queue, active) = (&mut self.engine, &mut self.queue, &mut self.active);
        // A cancelled prompt's sequence drops with it, freeing its blocks.
        active.retain(|a| !a.job.cancelled.load(Relaxed) && !a.job.out.is_closed());
        // Counted free below: what was dropped is given back first.
        engine.reclaim();
        let mut need_more: usize = active.iter().map(|a| blocks(a.job.prompt.len(), bs) - blocks(a.done, bs)).sum();
        let mut left = 0usize;
        while let Some(j) = queue.front() {
            let need = blocks(j.prompt.len(), bs);
            match admit_prompt(need, need_more, engine.free_blocks(), engine.total_blocks()) {
                Admit::Refuse => {
                    let Some(j) = queue.pop_front() else { break };
                    left += 1;
                    let what = format!("a prompt of {} tokens needs {need} KV blocks; this worker has {}", j.prompt.len(), engine.total_blocks());
                    let _ = j.out.send(Outbound::Failed(WorkerError::Exhausted(what)));
                    continue;
                }
                Admit::Wait => break,
                Admit::Start => {}
            }
            let Some(j) = queue.pop_front() else { break };
            left += 1;
            need_more += need;
            // Start on the prompt's cached prefix: only the rest is computed. A prompt whose
            // logprobs are asked for is computed whole (every position's logits).
            let started = match j.params.prompt_logprobs {
                Some(_) => Ok((engine.new_sequence_salted(&j.salt), 0)),
                None => engine.new_sequence_from_cache(&j.prompt, &j.salt),
            };
            let (seq, cached) = match started {
                Ok(started) => started,
                Err(e) => {
                    let _ = j.out.send(Outbound::Failed(WorkerError::InvalidRequest(format!("starting the prompt: {e}"))));
                    continue;
                }
            };
            let seq = engine.own(seq);
            j.cached.store(cached, Relaxed);
            if cached > 0 {
                tracing::debug!(request_id = %j.request_id, cached, prompt = j.prompt.len(), "prompt prefix served from the cache");
            }
            active.push(Active { job: j, seq, done: cached, started: Instant::now(), prompt_logprobs: Vec::new() });
        }
        for _ in 0..left {
            self.left_queue();
        }
    }
}

fn blocks(tokens: usize, bs: usize) -> usize {
    BlockTable::blocks_for(tokens, bs)
}

fn publish(engine: &mut Engine, load: &LoadGauge, queue: &VecDeque<PrefillJob>, active: &[Active], busy: f64) {
    load.publish(engine, Role::Prefill.as_str(), busy);
    let queued: usize = queue.iter().map(|j| j.prompt.len()).sum::<usize>() + active.iter().map(|a| a.job.prompt.len() - a.done).sum::<usize>();
    load.blocks_free.store(engine.free_blocks() as u64, Relaxed);
    load.active_sequences.store(engine.active_sequences() as u64, Relaxed);
    load.queued_prefill_tokens.store(queued as u64, Relaxed);
    load.queued_requests.store((queue.len() + active.len()) as u64, Relaxed);
    // The queue is FIFO: its front has waited longest (the gauge's age is taken at scrape time).
    load.set_oldest_queued(queue.front().map(|j| j.enqueued));
    load.export(Role::Prefill.as_str());
}

/// A prompt computed whole, its first tokens sampled: what its `Outbound::End` says.
struct Done {
    first: First,
    more_choices: Vec<FirstChoice>,
    prompt_logprobs: Vec<TokenLogprob>,
    queued: std::time::Duration,
    computed: std::time::Duration,
    computed_at: Instant,
}

/// One forward pass over the active prompts' next chunks (FIFO, up to the token budget). A
/// prompt whose chunk fails alone fails alone; Err only when the backend failed.
fn step(engine: &mut Engine, active: &mut Vec<Active>, budget: usize, tx: &std_mpsc::Sender<Cmd>, load: &LoadGauge) -> std::result::Result<(), EngineError> {
    let prompts: Vec<PromptLeft> = active.iter().map(|a| PromptLeft { left: a.job.prompt.len() - a.done, cap: logprobs::chunk_cap(&a.job.params) }).collect();
    // (index, range)
    let plan: Vec<(usize, std::ops::Range<usize>)> = plan_prefill(budget, &prompts).into_iter().map(|(i, n)| (i, active[i].done..active[i].done + n)).collect();
    // The finishing prompts' (plan item, seq, first token shipped, tokens shipped, buffers, out).
    let finishing: Vec<(usize, SeqId, usize, usize, bool, mpsc::UnboundedSender<Outbound>)> = plan
        .iter()
        .enumerate()
        .filter(|(_, (i, r))| r.end == active[*i].job.prompt.len())
        .map(|(k, (i, r))| {
            let j = &active[*i].job;
            (k, active[*i].seq.id(), j.ship_from, r.end - j.ship_from, j.buffers, j.out.clone())
        })
        .collect();
    let layout = engine.kv_layout();
    let items: Vec<StepItem> = plan
        .iter()
        .map(|(i, r)| {
            let a = &active[*i];
            let logits = logprobs::chunk_logits(&a.job.params, r, a.job.prompt.len());
            StepItem { seq: a.seq.id(), tokens: &a.job.prompt[r.clone()], logits }
        })
        .collect();
    let t0 = Instant::now();
    // Layer-wise streaming: each finishing prompt's layer leaves as soon as it is computed (when
    // an item runs alone, only its own layers).
    let result = step_isolating(engine, &items, &mut |which, l, kv| {
        for (k, seq, from, tokens, buffers, out) in &finishing {
            if which.is_some_and(|w| w != *k) {
                continue;
            }
            let offset = (l * layout.layer_bytes(*tokens)) as u64;
            let msg = if *buffers {
                kv.export_layer_buffer_from(*seq, l, *from).map(|buf| Outbound::Buffer { offset, buf })
            } else {
                let mut buf = Vec::with_capacity(layout.layer_bytes(*tokens));
                kv.export_layer_from(*seq, l, *from, &mut buf).map(|()| Outbound::layer(offset, Bytes::from(buf)))
            };
            // A layer that cannot be exported fails the transfer now (not as a short body later).
            let _ = out.send(msg.unwrap_or_else(|e| Outbound::Failed(WorkerError::Internal(format!("exporting KV layer {l}: {e}")))));
        }
    });
    drop(items);
    metrics::histogram!("ferry_worker_step_seconds", "role" => "prefill").record(t0.elapsed().as_secs_f64());
    let outcomes = result?;
    if outcomes.iter().all(|o| o.is_ok()) {
        load.record_prefill_step(plan.iter().map(|(_, r)| r.len()).sum(), t0.elapsed().as_secs_f64());
    }
    let mut leaving = Vec::new();
    for ((i, r), outcome) in plan.iter().zip(outcomes) {
        let a = &mut active[*i];
        let logits = match outcome {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(request_id = %a.job.request_id, "prefill step failed for this prompt alone: {e}");
                let _ = a.job.out.send(Outbound::Failed(sequence_error(&a.job.request_id, "prefill step", e)));
                leaving.push((*i, None));
                continue;
            }
        };
        a.done = r.end;
        let logits = logprobs::take_chunk(&a.job.params, &a.job.prompt, r.clone(), logits, &mut a.prompt_logprobs);
        if a.done == a.job.prompt.len() {
            let stop_ids = engine.stop_ids(&a.job.params);
            let firsts = match first_tokens(&a.job.params, &a.job.rules, &logits, &stop_ids) {
                Ok(f) => f,
                Err((choice, e)) => {
                    let what = format!("sampling the first token of choice {choice}: {e}");
                    let _ = a.job.out.send(Outbound::Failed(WorkerError::GrammarFailed { request_id: a.job.request_id.clone(), what }));
                    leaving.push((*i, None));
                    continue;
                }
            };
            let mut firsts = firsts.into_iter();
            let Some(first) = firsts.next() else { continue };
            let more_choices = firsts.map(|f| FirstChoice { token: f.token, is_stop: f.is_stop, sampler_state: f.picker.rng_state(), logprob: f.logprob }).collect();
            let prompt_logprobs = std::mem::take(&mut a.prompt_logprobs);
            let done = Done { first, more_choices, prompt_logprobs, queued: a.started - a.job.enqueued, computed: a.started.elapsed(), computed_at: Instant::now() };
            leaving.push((*i, Some(done)));
        }
    }
    // Leaving the batch: a finished prompt's sequence goes under a lease with its end (if the
    // transfer task is gone the message, and its lease, drop: blocks freed); a failed one's drops.
    for (i, done) in leaving.into_iter().rev() {
        let a = active.remove(i);
        let Some(Done { first, more_choices, prompt_logprobs, queued, computed, computed_at }) = done else { continue };
        let lease = SeqLease { seq: Some(a.seq), tx: tx.clone() };
        let end = Outbound::End {
            first_token: first.token,
            first_is_stop: first.is_stop,
            first_logprob: first.logprob,
            prompt_logprobs,
            sampler_state: first.picker.rng_state(),
            more_choices,
            queued,
            computed,
            computed_at,
            lease: Box::new(lease),
        };
        let _ = a.job.out.send(end);
    }
    Ok(())
}
