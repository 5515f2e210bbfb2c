//! The prefill worker: one engine thread runs queued prompts in batches up to a token budget,
//! streams each finished layer's KV to the request's transfer task, samples the first token, and
//! keeps the sequence's blocks under a lease until the decode worker has acknowledged them.
//!
//! The queue of prompts waiting to start is bounded ([`crate::prefill::PrefillOptions::queue_max`]): beyond it a
//! request is refused at once, RESOURCE_EXHAUSTED tagged `overloaded`, so the router tries
//! another worker or waits instead of piling prompts here. A step that fails for one prompt fails
//! that prompt alone ([`crate::isolate`]); a panic or a device fault fails them all and takes the
//! worker out ([`crate::fault`]).


use crate::error::WorkerError;
use crate::prefill::admission::{Cmd, PrefillJob, SeqLease};
use crate::fault::FaultInjection;
use crate::isolate::{sequence_error, step_isolating};
use crate::kv::send::{FirstChoice, Outbound};
use crate::load::LoadGauge;
use crate::logprobs;
use crate::pick::{first_tokens, First};
use crate::role::Role;
use bytes::Bytes;
use ferry_core::schedule::{admit_prompt, plan_prefill, Admit, PromptLeft};
use ferry_core::{BlockTable, TokenLogprob};
use ferry_engine::{Engine, EngineError, SeqId, Sequence, StepItem};
use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;

struct Active {
    job: PrefillJob,
    seq: Sequence,
    done: usize,
    started: Instant,
    /// The prompt's logprobs so far, when asked for ([`crate::logprobs`]).
    prompt_logprobs: Vec<TokenLogprob>,
}

/// The prefill engine thread's state.
pub(crate) struct PrefillThread {
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
    pub(crate) fn new(engine: Engine, load: Arc<LoadGauge>, faults: FaultInjection) -> Self {
        PrefillThread { engine, queue: VecDeque::new(), active: Vec::new(), load, faults, steps: 0, busy: 0.0 }
    }

    /// Every job the thread holds, being computed or waiting (to fail them after a fault).
    pub(crate) fn take_jobs(&mut self) -> Vec<PrefillJob> {
        self.active.drain(..).map(|a| a.job).chain(self.queue.drain(..)).collect()
    }

    /// One prompt left the waiting queue.
    fn left_queue(&self) {
        let _ = self.load.waiting_requests.fetch_update(Relaxed, Relaxed, |w| Some(w.saturating_sub(1)));
    }

    /// Run until every handle is gone (Ok) or the backend fails (Err: the engine is broken).
    pub(crate) fn run(&mut self, rx: &std_mpsc::Receiver<Cmd>, tx: &std_mpsc::Sender<Cmd>) -> std::result::Result<(), EngineError> {
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
            Cmd::Job(j) => {
                // Its disk blocks are read while it waits for its turn (the prompts ahead of it
                // step meanwhile).
                if j.params.prompt_logprobs.is_none() {
                    self.engine.prefetch_prefix(&j.prompt, &j.salt);
                }
                self.queue.push_back(j)
            }
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
    // One span per prompt chunk in this pass (none for a request that is not traced).
    let chunks: Vec<tracing::Span> = plan
        .iter()
        .map(|(i, r)| match !ferry_proto::trace::on() || active[*i].job.span.is_disabled() {
            true => tracing::Span::none(),
            false => tracing::info_span!(parent: &active[*i].job.span, "prefill_chunk", from = r.start, tokens = r.len(), batch = plan.len()),
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
    metrics::histogram!(crate::cluster::metrics::names::STEP_SECONDS, "role" => "prefill").record(t0.elapsed().as_secs_f64());
    drop(chunks);
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
        metrics::counter!(crate::cluster::metrics::names::PROMPT_TOKENS, "role" => "prefill").increment(r.len() as u64);
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
            let sampled = firsts.iter().filter(|f| !f.is_stop).count();
            metrics::counter!(crate::cluster::metrics::names::GENERATION_TOKENS, "role" => "prefill").increment(sampled as u64);
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
