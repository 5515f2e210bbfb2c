//! The continuous-batching engine thread of decode and colocated workers (Orca, OSDI '22): one
//! engine thread steps every running sequence each iteration, and sequences join and leave
//! between steps.
//!
//! A decode worker's sequences arrive as imported KV ([`super::import`]). A colocated worker
//! (the baseline that disaggregation is measured against) also takes prompts and prefills them
//! in the same loop, in one of two ways:
//! - **prefill first** (`chunk_tokens: None`, vLLM's classic scheduler): a step that has prompts
//!   to prefill runs only them, whole (up to the step budget); running decodes wait that step;
//! - **chunked prefill** (`chunk_tokens: Some(B)`, Sarathi-Serve, arXiv:2403.02310): every step
//!   carries all running decodes plus prompt chunks filling the rest of a budget of B tokens, so
//!   a long prompt never stalls decodes for more than one bounded step.
//!
//! A request with its first tokens joins the batch by [`super::fork`]; a choice leaves it by
//! [`super::finish`]. Every sequence is held as an `ferry_engine::Sequence`, so a request that
//! leaves by any path gives its blocks back. A step that fails for one sequence ends that
//! sequence only ([`crate::isolate`]); a panic or a device fault ends the engine thread, failing
//! everything it holds ([`crate::fault`]).

use super::admission::{Admission, Cmd, DecodeEvent, HeldPrefix, Scheduling, Source};
use super::finish::{advance, leave, Running};
use super::fork::{join, Joining, Start};
use super::speculate::Speculator;
use super::import::{import, Arrived, Request};
use crate::error::WorkerError;
use crate::fault::FaultInjection;
use crate::isolate::{sequence_error, step_isolating, Outcome};
use crate::load::{LoadGauge, Reservation};
use crate::logprobs;
use crate::pick::{first_tokens, Rules};
use ferry_core::logprobs::token_logprob;
use ferry_core::schedule::{plan_step, PromptLeft, StepPolicy};
use ferry_core::{SamplingParams, TokenLogprob};
use ferry_engine::{Engine, EngineError, FinishReason, Logits, Prefetch, Sequence, StepItem};
use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};

/// An attach waiting for its prefix's disk blocks, which the disk tier's reader thread reads
/// meanwhile (the engine thread steps the running sequences instead of reading them itself).
/// It waits up to [`ATTACH_READ_WAIT`] first: reads from the page cache end within it, and the
/// attach then answers at once rather than after the next step (a step can take far longer).
struct Attaching {
    tokens: Vec<u32>,
    salt: Vec<u8>,
    max: usize,
    reply: oneshot::Sender<(Sequence, usize)>,
    reading: Prefetch,
}

/// How long the engine thread waits for an attach's disk reads before it steps the running
/// sequences and looks again after the step: a bounded stall (a 2,048-token prefix of SmolLM2
/// reads from the page cache in ~20 ms) against a read from a slow disk stalling every sequence.
const ATTACH_READ_WAIT: Duration = Duration::from_millis(20);

/// A colocated prompt being prefilled.
struct Prefilling {
    request_id: String,
    seq: Sequence,
    prompt: Vec<u32>,
    done: usize,
    params: SamplingParams,
    /// The prompt's logprobs so far, when asked for ([`crate::logprobs`]).
    prompt_logprobs: Vec<TokenLogprob>,
    events: mpsc::UnboundedSender<DecodeEvent>,
    reservation: Reservation,
    rules: Rules,
}

/// The decode engine thread's state.
pub(super) struct DecodeThread {
    engine: Engine,
    running: Vec<Running>,
    prefilling: VecDeque<Prefilling>,
    load: Arc<LoadGauge>,
    scheduling: Scheduling,
    role: &'static str,
    faults: FaultInjection,
    /// Steps run so far (for [`FaultInjection::before_step`]).
    steps: u64,
    /// Seconds the loop was busy around its steps ([`LoadGauge::publish`]).
    busy: f64,
    speculator: Speculator,
    attaching: Vec<Attaching>,
}

/// One row group of a step.
enum RowGroup {
    Decode(usize),
    Prefill(usize, std::ops::Range<usize>),
}

impl DecodeThread {
    pub(super) fn new(engine: Engine, load: Arc<LoadGauge>, scheduling: Scheduling, role: &'static str, faults: FaultInjection) -> Self {
        let speculator = Speculator::for_engine(scheduling.spec, &engine);
        DecodeThread { engine, running: Vec::new(), prefilling: VecDeque::new(), load, scheduling, role, faults, steps: 0, busy: 0.0, speculator, attaching: Vec::new() }
    }

    /// Step until every handle is gone (Ok) or the backend fails (Err: the engine is broken).
    pub(super) fn run(&mut self, rx: &std_mpsc::Receiver<Cmd>) -> Result<(), EngineError> {
        let mut rotate = 0usize;
        loop {
            self.publish();
            if self.running.is_empty() && self.prefilling.is_empty() {
                // Idle but for attaches waiting on disk reads: look at them every millisecond.
                let cmd = match self.attaching.is_empty() {
                    true => rx.recv().map_err(|_| std_mpsc::RecvTimeoutError::Disconnected),
                    false => rx.recv_timeout(Duration::from_millis(1)),
                };
                match cmd {
                    Ok(cmd) => self.handle(cmd)?,
                    Err(std_mpsc::RecvTimeoutError::Timeout) => {}
                    Err(std_mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
                }
            }
            // Busy from here to the step's end: the admissions (a decode worker imports arriving
            // KV here), the plan, the step, sampling and streaming the tokens.
            let busy = Instant::now();
            while let Ok(cmd) = rx.try_recv() {
                self.handle(cmd)?;
            }
            self.attach_read();
            self.drop_cancelled();
            if self.running.is_empty() && self.prefilling.is_empty() {
                continue;
            }
            let parts = self.plan(&mut rotate);
            self.step(parts)?;
            self.busy += busy.elapsed().as_secs_f64();
        }
    }

    fn handle(&mut self, cmd: Cmd) -> Result<(), EngineError> {
        match cmd {
            Cmd::Admit(a) => return self.admit(a),
            Cmd::Attach { tokens, salt, max, reply } => {
                // The disk part of the prefix is read ahead; the attach waits for it (here for up
                // to ATTACH_READ_WAIT, then in `attach_read`), the pool part is taken then.
                let reading = self.engine.prefetch_prefix(&tokens[..(max + 1).min(tokens.len())], &salt);
                let waiting = Attaching { tokens, salt, max, reply, reading };
                match self.engine.prefetched(&waiting.reading, ATTACH_READ_WAIT) {
                    true => self.attach(waiting),
                    false => self.attaching.push(waiting),
                }
            }
            Cmd::Release(seq) => {
                let id = seq.id();
                if let Err(e) = self.engine.release_now(seq) {
                    tracing::error!("releasing held sequence {}: {e}", id.0);
                }
            }
        }
        Ok(())
    }

    /// Attach the waiting prefixes whose disk blocks are in memory now (or whose requester went
    /// away: nothing to attach).
    fn attach_read(&mut self) {
        let engine = &self.engine;
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.attaching).into_iter().partition(|a| a.reply.is_closed() || engine.prefetched(&a.reading, Duration::ZERO));
        self.attaching = waiting;
        for a in ready {
            self.attach(a);
        }
    }

    /// Start the sequence on the prefix cached now (its disk blocks read) and hand it over;
    /// nothing when the requester went away.
    fn attach(&mut self, Attaching { tokens, salt, max, reply, .. }: Attaching) {
        if reply.is_closed() {
            return;
        }
        let (seq, cached) = self.engine.new_sequence_with_prefix(&tokens, &salt, max.min(tokens.len()));
        // Nobody waits any more: the sequence drops with the reply, freeing its blocks.
        let _ = reply.send((self.engine.own(seq), cached));
    }

    /// The engine failed: every request held ends, tagged `engine` (the router moves them).
    pub(super) fn fail_all(&mut self, what: &str) {
        for r in self.running.drain(..) {
            leave(r, Err(WorkerError::EngineFailed(what.to_string())));
        }
        for p in self.prefilling.drain(..) {
            let _ = p.events.send(DecodeEvent::Failed(WorkerError::EngineFailed(what.to_string())));
        }
        self.publish();
    }

    fn publish(&mut self) {
        self.load.publish(&mut self.engine, self.role, self.busy);
        self.load.blocks_free.store(self.engine.free_blocks() as u64, Relaxed);
        self.load.active_sequences.store((self.running.len() + self.prefilling.len()) as u64, Relaxed);
        let queued: usize = self.prefilling.iter().map(|p| p.prompt.len() - p.done).sum();
        self.load.queued_prefill_tokens.store(queued as u64, Relaxed);
        self.load.queued_requests.store(self.prefilling.len() as u64, Relaxed);
        self.load.export(self.role);
    }

    /// Requests whose stream was dropped leave now (their sequences drop, freeing their blocks).
    fn drop_cancelled(&mut self) {
        self.running.retain(|r| !r.events.is_closed());
        self.prefilling.retain(|p| !p.events.is_closed());
        self.engine.reclaim();
    }

    /// Which rows the next step carries (see the module doc): [`ferry_core::schedule::plan_step`].
    fn plan(&self, rotate: &mut usize) -> Vec<RowGroup> {
        let policy = StepPolicy {
            max_batch_tokens: self.engine.max_batch_tokens(),
            accept_prompts: self.scheduling.accept_prompts,
            chunk_tokens: self.scheduling.chunk_tokens,
        };
        let prompts: Vec<PromptLeft> =
            self.prefilling.iter().map(|p| PromptLeft { left: p.prompt.len() - p.done, cap: logprobs::chunk_cap(&p.params) }).collect();
        let plan = plan_step(&policy, self.running.len(), &prompts, rotate);
        let decodes = plan.decodes.into_iter().map(RowGroup::Decode);
        decodes.chain(plan.prefills.into_iter().map(|(j, n)| RowGroup::Prefill(j, self.prefilling[j].done..self.prefilling[j].done + n))).collect()
    }
    /// One step over `parts`. A part whose sequence fails ends that request alone; Err only
    /// when the backend failed. A decode part carries its last token and the tokens proposed
    /// for it ([`super::speculate`]), and takes as many tokens as its picker accepts.
    fn step(&mut self, parts: Vec<RowGroup>) -> Result<(), EngineError> {
        let drafts = self.propose(&parts);
        // Each speculating sequence's length before the step, to roll back to.
        let held: Vec<usize> = parts
            .iter()
            .zip(&drafts)
            .map(|(p, d)| match p {
                RowGroup::Decode(i) if !d.is_empty() => self.engine.seq_len(self.running[*i].seq.id()).unwrap_or(0),
                _ => 0,
            })
            .collect();
        let toks: Vec<Vec<u32>> = parts
            .iter()
            .zip(&drafts)
            .map(|(p, d)| match p {
                // The test hook: an id outside any vocabulary makes this one item fail.
                RowGroup::Decode(i) if parts.len() > 1 && self.faults.fails(&self.running[*i].request_id, self.running[*i].count) => vec![u32::MAX],
                RowGroup::Decode(i) => std::iter::once(self.running[*i].last).chain(d.iter().copied()).collect(),
                RowGroup::Prefill(..) => Vec::new(),
            })
            .collect();
        let items: Vec<StepItem> = parts
            .iter()
            .zip(&toks)
            .map(|(p, t)| match p {
                RowGroup::Decode(i) => StepItem { seq: self.running[*i].seq.id(), tokens: t, logits: if t.len() > 1 { Logits::All } else { Logits::Last } },
                RowGroup::Prefill(j, r) => {
                    let p = &self.prefilling[*j];
                    let logits = logprobs::chunk_logits(&p.params, r, p.prompt.len());
                    StepItem { seq: p.seq.id(), tokens: &p.prompt[r.clone()], logits }
                }
            })
            .collect();
        self.faults.before_step(self.steps);
        self.steps += 1;
        let t0 = Instant::now();
        let outcomes = step_isolating(&mut self.engine, &items, &mut |_, _, _| {});
        drop(items);
        let seconds = t0.elapsed().as_secs_f64();
        metrics::histogram!(crate::cluster::metrics::names::STEP_SECONDS, "role" => self.role).record(seconds);
        // The pace at which prompts advance here, beside the decodes they share the step with:
        // what a turn computed here would wait for (`ferry_core::cache_policy::TurnTimes`).
        let prompt_tokens: usize = parts.iter().map(|p| if let RowGroup::Prefill(_, r) = p { r.len() } else { 0 }).sum();
        self.load.record_prefill_step(prompt_tokens, seconds);
        let decodes = parts.iter().filter(|p| matches!(p, RowGroup::Decode(_))).count();
        metrics::histogram!(crate::cluster::metrics::names::DECODE_BATCH_SIZE).record(decodes as f64);
        let outcomes: Vec<Outcome> = outcomes?;
        // Requests that leave the batch: finished, or failed alone.
        let mut leaving: Vec<(usize, Result<FinishReason, WorkerError>)> = Vec::new();
        let mut prefilled: Vec<(usize, Result<Vec<f32>, WorkerError>)> = Vec::new();
        for (((part, outcome), d), &held) in parts.iter().zip(outcomes).zip(&drafts).zip(&held) {
            match (part, outcome) {
                (RowGroup::Decode(i), Ok(logits)) => {
                    if let Some(end) = self.take_tokens(*i, logits, d, held) {
                        leaving.push((*i, end));
                    }
                }
                (RowGroup::Decode(i), Err(e)) => {
                    let r = &self.running[*i];
                    tracing::warn!(request_id = %r.request_id, "decode step failed for this sequence alone: {e}");
                    leaving.push((*i, Err(sequence_error(&r.request_id, "decode step", e))));
                }
                (RowGroup::Prefill(j, range), Ok(logits)) => {
                    let p = &mut self.prefilling[*j];
                    p.done = range.end;
                    metrics::counter!(crate::cluster::metrics::names::PROMPT_TOKENS, "role" => self.role).increment(range.len() as u64);
                    let logits = logprobs::take_chunk(&p.params, &p.prompt, range.clone(), logits, &mut p.prompt_logprobs);
                    if p.done == p.prompt.len() {
                        prefilled.push((*j, Ok(logits)));
                    }
                }
                (RowGroup::Prefill(j, _), Err(e)) => {
                    let p = &self.prefilling[*j];
                    tracing::warn!(request_id = %p.request_id, "prefill step failed for this sequence alone: {e}");
                    prefilled.push((*j, Err(sequence_error(&p.request_id, "prefill step", e))));
                }
            }
        }
        leaving.sort_by_key(|f| std::cmp::Reverse(f.0));
        for (i, end) in leaving {
            leave(self.running.swap_remove(i), end);
        }
        // Prompts done: sample their first token here and join the running batch.
        prefilled.sort_by_key(|f| std::cmp::Reverse(f.0));
        for (j, logits) in prefilled {
            let Some(p) = self.prefilling.remove(j) else { continue };
            let logits = match logits {
                Ok(l) => l,
                Err(e) => {
                    let _ = p.events.send(DecodeEvent::Failed(e));
                    continue;
                }
            };
            let stop_ids = self.engine.stop_ids(&p.params);
            let firsts = match first_tokens(&p.params, &p.rules, &logits, &stop_ids) {
                Ok(f) => f,
                Err((choice, e)) => {
                    let what = format!("sampling the first token of choice {choice}: {e}");
                    let _ = p.events.send(DecodeEvent::Failed(WorkerError::GrammarFailed { request_id: p.request_id, what }));
                    continue;
                }
            };
            if p.params.prompt_logprobs.is_some() {
                let _ = p.events.send(DecodeEvent::PromptLogprobs(p.prompt_logprobs));
            }
            let sampled = firsts.iter().filter(|f| !f.is_stop).count();
            metrics::counter!(crate::cluster::metrics::names::GENERATION_TOKENS, "role" => self.role).increment(sampled as u64);
            let mut choices = Vec::with_capacity(firsts.len());
            for (i, f) in firsts.into_iter().enumerate() {
                if !f.is_stop {
                    let _ = p.events.send(DecodeEvent::Token { choice: i as u32, token: f.token, logprob: f.logprob });
                }
                choices.push(Start { token: f.token, is_stop: f.is_stop, picker: f.picker });
            }
            let prompt_tokens = p.prompt.len();
            let joining =
                Joining { request_id: &p.request_id, seq: p.seq, choices, params: &p.params, prompt_tokens, events: p.events, reservation: p.reservation, context: &p.prompt };
            let joined = join(&mut self.engine, &mut self.speculator, joining);
            self.running.extend(joined);
        }
        if self.speculator.enabled() {
            metrics::histogram!(crate::cluster::metrics::names::SPEC_SECONDS).record(self.speculator.take_spent().as_secs_f64());
        }
        Ok(())
    }

    /// The tokens proposed for each decode part of this step (empty: none, and always for a
    /// prefill part). Proposals stay within the rows the backend computes as decode rows
    /// ([`Speculator::row_budget`]), within each request's `max_tokens` and the context, and
    /// within the free KV blocks (with one block more per speculating sequence, for the copy a
    /// rollback may need), so a proposal never makes a step fail that would not fail without it.
    fn propose(&mut self, parts: &[RowGroup]) -> Vec<Vec<u32>> {
        let mut drafts = vec![Vec::new(); parts.len()];
        if !self.speculator.enabled() {
            return drafts;
        }
        let (bs, ctx) = (self.engine.kv_layout().block_size, self.engine.config().max_position);
        let blocks = |tokens: usize| tokens.div_ceil(bs);
        let len_of = |e: &ferry_engine::Engine, seq: &Sequence| e.seq_len(seq.id()).unwrap_or(0);
        // What the step takes without proposals: its rows, and the blocks they fill.
        let (mut rows, mut need) = (0, 0);
        for p in parts {
            let (len, n) = match p {
                RowGroup::Decode(i) => (len_of(&self.engine, &self.running[*i].seq), 1),
                RowGroup::Prefill(j, r) => (len_of(&self.engine, &self.prefilling[*j].seq), r.len()),
            };
            rows += n;
            need += blocks(len + n) - blocks(len);
        }
        let mut room = self.speculator.row_budget().saturating_sub(rows);
        let mut free = self.engine.free_blocks().saturating_sub(need);
        // The sequences most likely to accept go first.
        let mut order: Vec<(usize, usize)> = parts.iter().enumerate().filter_map(|(k, p)| if let RowGroup::Decode(i) = p { Some((k, *i)) } else { None }).collect();
        let accept = |i: usize| self.running[i].spec.as_ref().map_or(0.0, |s| s.accept());
        order.sort_by(|a, b| accept(b.1).total_cmp(&accept(a.1)));
        for (k, i) in order {
            let len = len_of(&self.engine, &self.running[i].seq);
            let r = &mut self.running[i];
            let Some(s) = r.spec.as_mut() else { continue };
            let limit = room.min(r.max_tokens.saturating_sub(r.count + 1)).min(ctx.saturating_sub(len + 1));
            let want = self.speculator.wanted(s, limit);
            self.speculator.propose(s, want, &mut drafts[k]);
            // The test hook: garbage, as many as may go.
            self.faults.garble(&mut drafts[k], limit.min(self.speculator.max_tokens()), self.engine.config().vocab_size as u32, self.steps ^ k as u64);
            let n = drafts[k].len();
            if n == 0 {
                continue;
            }
            let extra = blocks(len + 1 + n) - blocks(len + 1) + 1;
            if extra > free {
                drafts[k].clear();
                continue;
            }
            free -= extra;
            room -= n;
        }
        drafts
    }

    /// Choose running choice `i`'s tokens from its rows of a step's logits: its last token's
    /// row, then one row per token proposed for it (`drafts`; the sequence held `held` tokens
    /// before the step). Tokens are chosen in order as plain decoding would choose them; a
    /// proposed token is kept when it is the one chosen at its position, and the first that is
    /// not ends the run: the KV of the proposals after it is rolled back. Some(end) when the
    /// choice leaves the batch.
    fn take_tokens(&mut self, i: usize, mut logits: Vec<f32>, drafts: &[u32], held: usize) -> Option<Result<FinishReason, WorkerError>> {
        let (vocab, ctx) = (self.engine.config().vocab_size, self.engine.config().max_position);
        let r = &mut self.running[i];
        let (mut accepted, mut emitted) = (0, 0);
        let mut end = None;
        for (j, row) in logits.chunks_exact_mut(vocab).enumerate() {
            let raw = r.logprobs.filter(|_| r.picker.alters_logits()).map(|_| row.to_vec());
            let tok = match r.picker.pick(row) {
                Ok(tok) => tok,
                Err(e) => {
                    let what = format!("at generated token {} of choice {}: {e}", r.count, r.choice);
                    end = Some(Err(WorkerError::GrammarFailed { request_id: r.request_id.clone(), what }));
                    break;
                }
            };
            // Logprobs are the model's, before the grammar's mask.
            let lp = r.logprobs.filter(|_| !r.stop_ids.contains(&tok)).map(|n| token_logprob(raw.as_deref().unwrap_or(row), tok, n as usize));
            if let Some(s) = r.spec.as_mut() {
                self.speculator.emitted(s, tok);
            }
            emitted += usize::from(!r.stop_ids.contains(&tok));
            if let Some(reason) = advance(r, tok, lp, ctx) {
                end = Some(Ok(reason));
                break;
            }
            if drafts.get(j) != Some(&tok) {
                break;
            }
            accepted += 1;
        }
        metrics::counter!(crate::cluster::metrics::names::GENERATION_TOKENS, "role" => self.role).increment(emitted as u64);
        if drafts.is_empty() {
            return end;
        }
        if let Some(s) = r.spec.as_mut() {
            self.speculator.verified(s, drafts.len(), accepted, emitted);
        }
        if end.is_none() && accepted < drafts.len() {
            // The cache holds the last token and the accepted proposals; the rest goes.
            let t = Instant::now();
            if let Err(e) = self.engine.truncate(r.seq.id(), held + 1 + accepted) {
                tracing::warn!(request_id = %r.request_id, "rolling back rejected proposals failed for this sequence alone: {e}");
                end = Some(Err(sequence_error(&r.request_id, "rolling back rejected proposals", e)));
            }
            self.speculator.charge(t.elapsed());
        }
        end
    }

    /// Take a request in. Err only when importing its KV failed at the backend (the engine is
    /// broken; the request has its failure already).
    fn admit(&mut self, a: Admission) -> Result<(), EngineError> {
        let Admission { request_id, source, params, prompt_tokens, events, reservation, rules } = a;
        match source {
            Source::Kv { payload, device, firsts, onto, tokens, context, imported } => {
                let request = Request { request_id: &request_id, params: &params, rules: &rules, events: &events };
                let arrived = Arrived { payload, device, firsts, onto, tokens, imported };
                let Some((seq, choices)) = import(&mut self.engine, &request, arrived)? else { return Ok(()) };
                // The router already streamed the first tokens (they came with prefill's answer).
                let joining = Joining { request_id: &request_id, seq, choices, params: &params, prompt_tokens, events, reservation, context: &context };
                let joined = join(&mut self.engine, &mut self.speculator, joining);
                self.running.extend(joined);
            }
            Source::Prompt { prompt, held } => {
                // A prompt whose logprobs are asked for is computed whole (dropping a held
                // prefix frees it).
                let held = held.filter(|_| params.prompt_logprobs.is_none());
                let cached = held.as_ref().map_or(0, |h| h.cached);
                let (seq, done) = match held.and_then(HeldPrefix::take) {
                    Some(seq) => (seq, cached),
                    None => {
                        let id = self.engine.new_sequence();
                        (self.engine.own(id), 0)
                    }
                };
                self.prefilling.push_back(Prefilling {
                    request_id,
                    seq,
                    prompt,
                    done,
                    params,
                    prompt_logprobs: Vec::new(),
                    events,
                    reservation,
                    rules,
                });
            }
        }
        Ok(())
    }
}
