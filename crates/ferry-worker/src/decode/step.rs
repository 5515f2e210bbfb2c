//! The continuous-batching engine loop of decode and colocated workers (Orca, OSDI '22): one
//! engine thread steps every running sequence each iteration, and sequences join and leave
//! between steps.
//!
//! A decode worker's sequences arrive as imported KV. A colocated worker (the baseline that
//! disaggregation is measured against) also takes prompts and prefills them in the same loop, in
//! one of two ways:
//! - **prefill first** (`chunk_tokens: None`, vLLM's classic scheduler): a step that has prompts
//!   to prefill runs only them, whole (up to the step budget); running decodes wait that step;
//! - **chunked prefill** (`chunk_tokens: Some(B)`, Sarathi-Serve, arXiv:2403.02310): every step
//!   carries all running decodes plus prompt chunks filling the rest of a budget of B tokens, so
//!   a long prompt never stalls decodes for more than one bounded step.
//!
//! A step that fails for one sequence ends that sequence only ([`crate::isolate`]); a panic or
//! a device fault ends the engine thread, failing everything it holds ([`crate::fault`]).

use crate::fault::{panic_message, EngineFault, FaultInjection};
use crate::isolate::{sequence_error, step_isolating, Outcome};
use crate::load::{LoadGauge, Reservation};
use crate::pick::{first_tokens, resume_pickers, Picker, Rules};
use crate::facts::ModelFacts;
use crate::error::{Result, WorkerError};
use crate::logprobs;
use ferry_core::logprobs::token_logprob;
use ferry_core::schedule::{plan_step, PromptLeft, StepPolicy};
use ferry_core::{SamplingParams, TokenLogprob};
use ferry_core::finish::{After, Bounds};
use ferry_engine::{Engine, EngineError, FinishReason, Logits, SeqId, StepItem};
use ferry_proto::v1::KvEnd;
use std::collections::VecDeque;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

pub enum DecodeEvent {
    /// A generated token of choice `choice` (0 unless `SamplingParams::n` > 1), with its logprob
    /// when asked for (`SamplingParams::logprobs`).
    Token { choice: u32, token: u32, logprob: Option<TokenLogprob> },
    /// The prompt's logprobs (`SamplingParams::prompt_logprobs`), before the first token, when
    /// this worker computed the prompt.
    PromptLogprobs(Vec<TokenLogprob>),
    /// Choice `choice` ended; the request ends with its last choice.
    Finished { choice: u32, reason: FinishReason, completion_tokens: u32 },
    /// The request ended with this error (its sequence is freed).
    Failed(WorkerError),
}

/// Where an admitted sequence's KV comes from.
pub enum Source {
    /// Shipped by a prefill worker: import it; `imported` gets the outcome and the buffer back.
    /// `device`: the body, when it arrived device to device (`payload` is then the header alone).
    /// `onto`: the sequence that holds the prompt's cached prefix, which the payload (a span from
    /// its end) extends; `tokens`: the payload's token ids, so its full blocks are cached here.
    Kv {
        payload: Vec<u8>,
        device: Option<ferry_engine::KvBuffer>,
        end: KvEnd,
        onto: Option<HeldPrefix>,
        tokens: Option<Vec<u32>>,
        imported: oneshot::Sender<(std::result::Result<(), Status>, Vec<u8>)>,
    },
    /// Compute the prompt here (colocated; or a decode worker's short suffix after a cached
    /// prefix), starting on the prefix `held` holds when there is one.
    Prompt { prompt: Vec<u32>, held: Option<HeldPrefix> },
}

/// What the engine thread is asked.
enum Cmd {
    Admit(Admission),
    /// Start a sequence on the longest cached prefix of `tokens` (at most `max` tokens).
    Attach { tokens: Vec<u32>, salt: Vec<u8>, max: usize, reply: oneshot::Sender<(SeqId, usize)> },
    Release(SeqId),
}

/// A sequence started on a cached prefix, not yet running: its blocks are held (they cannot be
/// evicted) until it runs, and freed if it is dropped first (the request failed or went away).
pub struct HeldPrefix {
    seq: Option<SeqId>,
    /// Leading prompt tokens it holds (whole blocks; 0 when nothing was cached).
    pub cached: usize,
    tx: std_mpsc::Sender<Cmd>,
}

impl HeldPrefix {
    fn take(mut self) -> Option<SeqId> {
        self.seq.take()
    }
}

impl Drop for HeldPrefix {
    fn drop(&mut self) {
        if let Some(seq) = self.seq.take() {
            let _ = self.tx.send(Cmd::Release(seq));
        }
    }
}

/// A request handed to the engine thread.
pub struct Admission {
    pub request_id: String,
    pub source: Source,
    pub params: SamplingParams,
    pub prompt_tokens: usize,
    pub events: mpsc::UnboundedSender<DecodeEvent>,
    pub reservation: Reservation,
    /// The structured-output matcher, over the completion so far (not yet the first token).
    pub rules: Rules,
}

/// How a worker schedules its steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Scheduling {
    /// Takes prompts (a colocated worker).
    pub accept_prompts: bool,
    /// Chunked prefill with this token budget per step; None: prefill first, whole prompts.
    pub chunk_tokens: Option<usize>,
}

struct Running {
    request_id: String,
    /// Which of the request's choices this sequence is (`SamplingParams::n`).
    choice: u32,
    seq: SeqId,
    picker: Picker,
    stop_ids: Vec<u32>,
    count: usize,
    last: u32,
    prompt_tokens: usize,
    max_tokens: usize,
    /// Alternatives per token when logprobs are asked for.
    logprobs: Option<u32>,
    events: mpsc::UnboundedSender<DecodeEvent>,
    /// The request's KV reservation, shared by its choices: released with the last.
    _reservation: Arc<Reservation>,
}

struct Prefilling {
    request_id: String,
    seq: SeqId,
    prompt: Vec<u32>,
    done: usize,
    params: SamplingParams,
    /// The prompt's logprobs so far, when asked for ([`crate::logprobs`]).
    prompt_logprobs: Vec<TokenLogprob>,
    events: mpsc::UnboundedSender<DecodeEvent>,
    reservation: Reservation,
    rules: Rules,
}

#[derive(Clone)]
pub struct DecodeHandle {
    tx: std_mpsc::Sender<Cmd>,
    pub load: Arc<LoadGauge>,
    pub facts: ModelFacts,
    pub scheduling: Scheduling,
    /// Set when the engine thread failed (see [`crate::fault`]).
    pub fault: Arc<EngineFault>,
}

impl DecodeHandle {
    pub fn admit(&self, a: Admission) -> Result<()> {
        self.tx.send(Cmd::Admit(a)).map_err(|_| WorkerError::ShuttingDown)
    }

    /// A new sequence on the longest prefix of `tokens` cached under `salt` (whole blocks, at most
    /// `max` tokens; nothing with the cache off), held until an admission takes it.
    pub async fn attach(&self, tokens: Vec<u32>, salt: Vec<u8>, max: usize) -> Result<HeldPrefix> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Cmd::Attach { tokens, salt, max, reply }).map_err(|_| WorkerError::ShuttingDown)?;
        let (seq, cached) = rx.await.map_err(|_| WorkerError::ShuttingDown)?;
        Ok(HeldPrefix { seq: Some(seq), cached, tx: self.tx.clone() })
    }
}

pub fn spawn(engine: Engine, model: String, scheduling: Scheduling) -> DecodeHandle {
    spawn_with(engine, model, scheduling, FaultInjection::default())
}

/// [`spawn`], with failures injected on purpose (tests).
pub fn spawn_with(engine: Engine, model: String, scheduling: Scheduling, faults: FaultInjection) -> DecodeHandle {
    let (tx, rx) = std_mpsc::channel();
    let load = Arc::new(LoadGauge::default());
    load.blocks_total.store(engine.total_blocks() as u64, Relaxed);
    load.blocks_free.store(engine.free_blocks() as u64, Relaxed);
    load.block_size.store(engine.kv_layout().block_size as u64, Relaxed);
    let facts = ModelFacts::of(&engine, model);
    let fault = EngineFault::new();
    let handle = DecodeHandle { tx, load: load.clone(), facts, scheduling, fault: fault.clone() };
    let role = if scheduling.accept_prompts { "colocated" } else { "decode" };
    std::thread::Builder::new()
        .name(format!("ferry-{role}"))
        .spawn(move || {
            let mut lp = StepLoop { engine, running: Vec::new(), prefilling: VecDeque::new(), load, scheduling, role, faults, steps: 0, busy: 0.0 };
            let what = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| lp.run(&rx))) {
                Ok(Ok(())) => return,
                Ok(Err(e)) => format!("a {role} step failed at the backend: {e}"),
                Err(p) => format!("the {role} engine thread panicked: {}", panic_message(p.as_ref())),
            };
            tracing::error!("{what}: failing every request this worker holds and taking it out");
            fault.report(what.clone());
            lp.fail_all(&what);
            while let Ok(cmd) = rx.try_recv() {
                if let Cmd::Admit(a) = cmd {
                    fail_admission(a, &what);
                }
            }
        })
        .expect("spawn the engine thread");
    handle
}

/// An admission the failed engine never took: its request fails, tagged `engine`.
fn fail_admission(a: Admission, what: &str) {
    let e = WorkerError::EngineFailed(what.to_string());
    match a.source {
        Source::Kv { payload, imported, .. } => {
            let _ = imported.send((Err(e.status()), payload));
        }
        Source::Prompt { .. } => {
            let _ = a.events.send(DecodeEvent::Failed(e));
        }
    }
}

struct StepLoop {
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
}

/// One row group of a step.
enum RowGroup {
    Decode(usize),
    Prefill(usize, std::ops::Range<usize>),
}

impl StepLoop {
    /// Step until every handle is gone (Ok) or the backend fails (Err: the engine is broken).
    fn run(&mut self, rx: &std_mpsc::Receiver<Cmd>) -> std::result::Result<(), EngineError> {
        let mut rotate = 0usize;
        loop {
            self.publish();
            if self.running.is_empty() && self.prefilling.is_empty() {
                match rx.recv() {
                    Ok(cmd) => self.handle(cmd)?,
                    Err(_) => return Ok(()),
                }
            }
            // Busy from here to the step's end: the admissions (a decode worker imports arriving
            // KV here), the plan, the step, sampling and streaming the tokens.
            let busy = Instant::now();
            while let Ok(cmd) = rx.try_recv() {
                self.handle(cmd)?;
            }
            self.drop_cancelled();
            if self.running.is_empty() && self.prefilling.is_empty() {
                continue;
            }
            let parts = self.plan(&mut rotate);
            self.step(parts)?;
            self.busy += busy.elapsed().as_secs_f64();
        }
    }

    fn handle(&mut self, cmd: Cmd) -> std::result::Result<(), EngineError> {
        match cmd {
            Cmd::Admit(a) => return self.admit(a),
            Cmd::Attach { tokens, salt, max, reply } => {
                let (seq, cached) = self.engine.new_sequence_with_prefix(&tokens, &salt, max.min(tokens.len()));
                if reply.send((seq, cached)).is_err() {
                    let _ = self.engine.release(seq);
                }
            }
            Cmd::Release(seq) => {
                if let Err(e) = self.engine.release(seq) {
                    tracing::error!("releasing held sequence {}: {e}", seq.0);
                }
            }
        }
        Ok(())
    }

    /// The engine failed: every request held ends, tagged `engine` (the router moves them).
    fn fail_all(&mut self, what: &str) {
        for r in self.running.drain(..) {
            let _ = self.engine.release(r.seq);
            let _ = r.events.send(DecodeEvent::Failed(WorkerError::EngineFailed(what.to_string())));
        }
        for p in self.prefilling.drain(..) {
            let _ = self.engine.release(p.seq);
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

    /// Requests whose stream was dropped leave now, freeing their blocks.
    fn drop_cancelled(&mut self) {
        let engine = &mut self.engine;
        self.running.retain(|r| {
            let keep = !r.events.is_closed();
            if !keep {
                let _ = engine.release(r.seq);
            }
            keep
        });
        self.prefilling.retain(|p| {
            let keep = !p.events.is_closed();
            if !keep {
                let _ = engine.release(p.seq);
            }
            keep
        });
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
    /// when the backend failed.
    fn step(&mut self, parts: Vec<RowGroup>) -> std::result::Result<(), EngineError> {
        let toks: Vec<[u32; 1]> = parts
            .iter()
            .map(|p| match p {
                // The test hook: an id outside any vocabulary makes this one item fail.
                RowGroup::Decode(i) if parts.len() > 1 && self.faults.fails(&self.running[*i].request_id, self.running[*i].count) => [u32::MAX],
                RowGroup::Decode(i) => [self.running[*i].last],
                RowGroup::Prefill(..) => [0],
            })
            .collect();
        let items: Vec<StepItem> = parts
            .iter()
            .zip(&toks)
            .map(|(p, t)| match p {
                RowGroup::Decode(i) => StepItem { seq: self.running[*i].seq, tokens: t, logits: Logits::Last },
                RowGroup::Prefill(j, r) => {
                    let p = &self.prefilling[*j];
                    let logits = logprobs::chunk_logits(&p.params, r, p.prompt.len());
                    StepItem { seq: p.seq, tokens: &p.prompt[r.clone()], logits }
                }
            })
            .collect();
        self.faults.before_step(self.steps);
        self.steps += 1;
        let t0 = Instant::now();
        let outcomes = step_isolating(&mut self.engine, &items, &mut |_, _, _| {});
        drop(items);
        metrics::histogram!("ferry_worker_step_seconds", "role" => self.role).record(t0.elapsed().as_secs_f64());
        let decodes = parts.iter().filter(|p| matches!(p, RowGroup::Decode(_))).count();
        metrics::histogram!("ferry_worker_decode_batch").record(decodes as f64);
        let outcomes: Vec<Outcome> = outcomes?;
        let ctx = self.engine.config().max_position;
        // Requests that leave the batch: finished, or failed alone.
        let mut leaving: Vec<(usize, std::result::Result<FinishReason, WorkerError>)> = Vec::new();
        let mut prefilled: Vec<(usize, std::result::Result<Vec<f32>, WorkerError>)> = Vec::new();
        for (part, outcome) in parts.iter().zip(outcomes) {
            match (part, outcome) {
                (RowGroup::Decode(i), Ok(mut logits)) => {
                    let r = &mut self.running[*i];
                    let raw = r.logprobs.filter(|_| r.picker.alters_logits()).map(|_| logits.clone());
                    match r.picker.pick(&mut logits) {
                        Ok(tok) => {
                            // Logprobs are the model's, before the grammar's mask.
                            let lp = r.logprobs.filter(|_| !r.stop_ids.contains(&tok)).map(|n| token_logprob(raw.as_deref().unwrap_or(&logits), tok, n as usize));
                            if let Some(reason) = advance(r, tok, lp, ctx) {
                                leaving.push((*i, Ok(reason)));
                            }
                        }
                        Err(e) => {
                            let what = format!("at generated token {} of choice {}: {e}", r.count, r.choice);
                            leaving.push((*i, Err(WorkerError::GrammarFailed { request_id: r.request_id.clone(), what })));
                        }
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
            let r = self.running.swap_remove(i);
            let _ = self.engine.release(r.seq);
            let _ = r.events.send(match end {
                Ok(reason) => DecodeEvent::Finished { choice: r.choice, reason, completion_tokens: r.count as u32 },
                Err(e) => DecodeEvent::Failed(e),
            });
        }
        // Prompts done: sample their first token here and join the running batch.
        prefilled.sort_by_key(|f| std::cmp::Reverse(f.0));
        for (j, logits) in prefilled {
            let Some(p) = self.prefilling.remove(j) else { continue };
            let logits = match logits {
                Ok(l) => l,
                Err(e) => {
                    let _ = self.engine.release(p.seq);
                    let _ = p.events.send(DecodeEvent::Failed(e));
                    continue;
                }
            };
            let stop_ids = self.engine.stop_ids(&p.params);
            let firsts = match first_tokens(&p.params, &p.rules, &logits, &stop_ids) {
                Ok(f) => f,
                Err((choice, e)) => {
                    let _ = self.engine.release(p.seq);
                    let what = format!("sampling the first token of choice {choice}: {e}");
                    let _ = p.events.send(DecodeEvent::Failed(WorkerError::GrammarFailed { request_id: p.request_id, what }));
                    continue;
                }
            };
            if p.params.prompt_logprobs.is_some() {
                let _ = p.events.send(DecodeEvent::PromptLogprobs(p.prompt_logprobs));
            }
            let mut choices = Vec::with_capacity(firsts.len());
            for (i, f) in firsts.into_iter().enumerate() {
                if !f.is_stop {
                    let _ = p.events.send(DecodeEvent::Token { choice: i as u32, token: f.token, logprob: f.logprob });
                }
                choices.push(Start { token: f.token, is_stop: f.is_stop, picker: f.picker });
            }
            let (seq, prompt_tokens) = (p.seq, p.prompt.len());
            self.start(&p.request_id, seq, choices, &p.params, prompt_tokens, p.events, p.reservation);
        }
        Ok(())
    }

    /// Take a request in. Err only when importing its KV failed at the backend (the engine is
    /// broken; the request has its failure already).
    fn admit(&mut self, a: Admission) -> std::result::Result<(), EngineError> {
        match a.source {
            Source::Kv { payload, device, end, onto, tokens, imported } => {
                let onto = onto.and_then(HeldPrefix::take);
                let tokens = tokens.as_deref();
                let seq = match (onto, &device) {
                    (Some(seq), Some(body)) => self.engine.import_kv_buffer_onto(seq, &payload, body, tokens).map(|()| seq),
                    (Some(seq), None) => self.engine.import_kv_onto(seq, &payload, tokens).map(|()| seq),
                    (None, Some(body)) => self.engine.import_kv_buffer(&payload, body),
                    (None, None) => self.engine.import_kv(&payload),
                };
                if seq.is_err()
                    && let Some(held) = onto
                {
                    let _ = self.engine.release(held);
                }
                drop(device);
                let seq = match seq {
                    Ok(seq) => seq,
                    Err(e) if e.is_device_fault() => {
                        let what = format!("importing the KV of request {}: {e}", a.request_id);
                        let _ = imported.send((Err(WorkerError::EngineFailed(what).status()), payload));
                        return Err(e);
                    }
                    Err(e) => {
                        let _ = imported.send((Err(Status::from(WorkerError::from(e))), payload));
                        return Ok(());
                    }
                };
                if imported.send((Ok(()), payload)).is_err() {
                    let _ = self.engine.release(seq);
                    return Ok(());
                }
                // The first tokens were sampled under the grammar on the prefill worker: each
                // choice's matcher here takes its own before sampling the next.
                let n = a.params.n.max(1) as usize;
                let mut firsts = vec![(end.first_token, end.first_is_stop, end.sampler_state)];
                firsts.extend(end.more_choices.iter().map(|f| (f.token, f.is_stop, f.sampler_state)));
                if firsts.len() != n {
                    let _ = self.engine.release(seq);
                    let what = format!("the KV's end carries first tokens for {} choices; the request has {n}", firsts.len());
                    let _ = a.events.send(DecodeEvent::Failed(WorkerError::SequenceFailed { request_id: a.request_id, what }));
                    return Ok(());
                }
                let pickers = match resume_pickers(&a.params, &a.rules, &firsts) {
                    Ok(p) => p,
                    Err((choice, token, e)) => {
                        let _ = self.engine.release(seq);
                        let what = format!("on the first token {token} of choice {choice}: {e}");
                        let _ = a.events.send(DecodeEvent::Failed(WorkerError::GrammarFailed { request_id: a.request_id, what }));
                        return Ok(());
                    }
                };
                let choices = firsts.iter().zip(pickers).map(|(&(token, is_stop, _), picker)| Start { token, is_stop, picker }).collect();
                // The router already streamed the first tokens (they came with prefill's answer).
                self.start(&a.request_id, seq, choices, &a.params, a.prompt_tokens, a.events, a.reservation);
            }
            Source::Prompt { prompt, held } => {
                // A prompt whose logprobs are asked for is computed whole (dropping a held
                // prefix frees it).
                let held = held.filter(|_| a.params.prompt_logprobs.is_none());
                let (seq, done) = match held.as_ref().map(|h| h.cached) {
                    Some(cached) => match held.and_then(HeldPrefix::take) {
                        Some(seq) => (seq, cached),
                        None => (self.engine.new_sequence(), 0),
                    },
                    None => (self.engine.new_sequence(), 0),
                };
                self.prefilling.push_back(Prefilling {
                    request_id: a.request_id,
                    seq,
                    prompt,
                    done,
                    params: a.params,
                    prompt_logprobs: Vec::new(),
                    events: a.events,
                    reservation: a.reservation,
                    rules: a.rules,
                });
            }
        }
        Ok(())
    }

    /// A request whose first tokens are known joins the running batch, one sequence per choice
    /// that its first token does not already finish: the first such choice runs on `seq`, each
    /// other on a fork of it (sharing the prompt's full blocks, with its own copy of the last
    /// partial one). `seq` is released if no choice needs it.
    #[allow(clippy::too_many_arguments)]
    fn start(
        &mut self,
        request_id: &str,
        seq: SeqId,
        choices: Vec<Start>,
        params: &SamplingParams,
        prompt_tokens: usize,
        events: mpsc::UnboundedSender<DecodeEvent>,
        reservation: Reservation,
    ) {
        let stop_ids = self.engine.stop_ids(params);
        let reservation = Arc::new(reservation);
        let mut seq = Some(seq);
        let mut joined: Vec<Running> = Vec::new();
        let mut ended = Vec::new();
        for (i, Start { token: first, is_stop: first_is_stop, picker }) in choices.into_iter().enumerate() {
            let choice = i as u32;
            let count = usize::from(!first_is_stop);
            let bounds = Bounds { stop_ids: &stop_ids, max_tokens: params.max_tokens, prompt_tokens, context: self.engine.config().max_position };
            let finish = match first_is_stop {
                true => Some(FinishReason::StopToken(first)),
                false => bounds.after(After { token: first, count, grammar_done: picker.finished(), stop_string: false }),
            };
            if let Some(reason) = finish {
                ended.push(DecodeEvent::Finished { choice, reason, completion_tokens: count as u32 });
                continue;
            }
            // The first continuing choice takes `seq`; every other a fork of the prompt's KV.
            let own = match joined.first() {
                None => seq.take().ok_or(None),
                Some(lead) => self.engine.fork(lead.seq).map_err(Some),
            };
            let own = match own {
                Ok(s) => s,
                Err(e) => {
                    let what = format!("forking the prompt's KV for choice {choice}: {}", e.map_or_else(|| "no sequence".to_string(), |e| e.to_string()));
                    for r in joined {
                        let _ = self.engine.release(r.seq);
                    }
                    if let Some(s) = seq {
                        let _ = self.engine.release(s);
                    }
                    let _ = events.send(DecodeEvent::Failed(WorkerError::SequenceFailed { request_id: request_id.to_string(), what }));
                    return;
                }
            };
            joined.push(Running {
                request_id: request_id.to_string(),
                choice,
                seq: own,
                picker,
                stop_ids: stop_ids.clone(),
                count,
                last: first,
                prompt_tokens,
                max_tokens: params.max_tokens,
                logprobs: params.logprobs,
                events: events.clone(),
                _reservation: reservation.clone(),
            });
        }
        if let Some(s) = seq {
            let _ = self.engine.release(s);
        }
        for e in ended {
            let _ = events.send(e);
        }
        if !joined.is_empty() {
            tracing::debug!(request_id, choices = joined.len(), "joined the running batch");
        }
        self.running.extend(joined);
    }
}

/// One choice's first token and chooser, as a request joins the running batch.
struct Start {
    token: u32,
    is_stop: bool,
    picker: Picker,
}

/// Account for a newly sampled token (`lp`: its logprob, when asked for); Some(reason) when the
/// sequence is finished.
fn advance(r: &mut Running, tok: u32, lp: Option<TokenLogprob>, ctx: usize) -> Option<FinishReason> {
    let bounds = Bounds { stop_ids: &r.stop_ids, max_tokens: r.max_tokens, prompt_tokens: r.prompt_tokens, context: ctx };
    if let Some(f) = bounds.stops(tok) {
        return Some(f);
    }
    r.count += 1;
    r.last = tok;
    let _ = r.events.send(DecodeEvent::Token { choice: r.choice, token: tok, logprob: lp });
    bounds.after(After { token: tok, count: r.count, grammar_done: r.picker.finished(), stop_string: false })
}
