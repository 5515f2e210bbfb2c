//! The `Decode` service of decode and colocated workers: admits a request only if the KV cache
//! can hold prompt + max_tokens, then either waits for its KV from a prefill worker (with a
//! timeout) and imports it, or (colocated) hands the prompt to the engine loop to prefill; then
//! streams the tokens the continuous-batching loop ([`super::step`], through [`super::handle`]) produces.

use crate::cluster::drain::Drain;
use crate::kv::receive::{Delivery, KvReceiver, Ticket};
use crate::pick::{rules_for, Rules};
use crate::load::Reservation;
use crate::error::{Result, WorkerError};
use ferry_core::SamplingParams;
use ferry_core::cache_policy::TurnTimes;
use ferry_engine::FinishReason;
use ferry_proto::v1::{decode_response, Admitted, DecodeFinal, DecodeRequest, DecodeResponse, DecodeTokens, PromptLogprobs};
use ferry_proto::MIN_TRANSFER_TOKEN_LEN;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use super::admission::{Admission, DecodeEvent, FirstToken, HeldPrefix, Source};
use super::handle::DecodeHandle;

/// The gRPC `Decode` service.
pub struct DecodeService {
    pub engine: DecodeHandle,
    pub receiver: Arc<KvReceiver>,
    /// The TCP data path's address, offered to senders (empty: gRPC only).
    pub data_addr: String,
    pub kv_timeout: Duration,
    pub name: String,
    /// Held by every admitted request until its stream ends.
    pub drain: Arc<Drain>,
}

/// Where an admitted request's prompt KV comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Plan {
    /// From a prefill worker, after the prefix cached here.
    Receive,
    /// Computed here: the router allowed it and only a short suffix after a cached prefix is left.
    Local,
    /// Computed here: a colocated worker's prompt.
    Colocated,
}

impl Plan {
    /// The router's `local_max`, what this worker holds, and how soon each path would be done
    /// decide (`ferry_core::cache_policy::plan_turn`).
    fn of(colocated: bool, prompt: usize, cached: usize, local_max: usize, block_size: usize, times: TurnTimes) -> Plan {
        use ferry_core::cache_policy::{plan_turn, TurnFacts, TurnPlan};
        let facts = TurnFacts { prompt_tokens: prompt, decode_held: cached, prefill_held: 0, block_size };
        match (colocated, plan_turn(facts, local_max, times)) {
            (true, _) => Plan::Colocated,
            (false, TurnPlan::Local { .. }) => Plan::Local,
            (false, TurnPlan::Remote { .. }) => Plan::Receive,
        }
    }
}

type EventStream = Pin<Box<dyn Stream<Item = std::result::Result<DecodeResponse, Status>> + Send>>;

fn event(e: decode_response::Event) -> DecodeResponse {
    DecodeResponse { event: Some(e) }
}

pub fn finish_to_wire(r: FinishReason) -> ferry_proto::v1::FinishReason {
    use ferry_proto::v1::FinishReason as W;
    match r {
        FinishReason::Length => W::Length,
        FinishReason::StopToken(_) => W::StopToken,
        FinishReason::StopString => W::StopString,
        FinishReason::ContextFull => W::ContextFull,
    }
}

impl DecodeService {
    /// Refuses `req` unless it can run here: the role, the prompt, the transfer token, sampling,
    /// and room in the KV cache (reserved on success).
    async fn admit(&self, req: &DecodeRequest) -> Result<Admit> {
        let facts = &self.engine.facts;
        if !req.prompt.is_empty() && !self.engine.scheduling.accept_prompts {
            return Err(WorkerError::InvalidRequest("this is a decode worker: prompts go to prefill or colocated workers".into()));
        }
        if !req.prompt.is_empty() && !req.prompt_ids.is_empty() {
            return Err(WorkerError::InvalidRequest("prompt_ids (a disaggregated request's prompt) and prompt (a colocated one) are exclusive".into()));
        }
        // The prompt's ids, when sent (a colocated prompt, or a disaggregated one for the cache).
        for (ids, name) in [(&req.prompt, "prompt"), (&req.prompt_ids, "prompt_ids")] {
            if ids.is_empty() {
                continue;
            }
            facts.check_prompt(ids)?;
            if req.prompt_tokens as usize != ids.len() {
                return Err(WorkerError::InvalidRequest(format!("prompt_tokens {} does not match the {} ids of {name}", req.prompt_tokens, ids.len())));
            }
        }
        if req.prompt.is_empty() && req.transfer_token.len() < MIN_TRANSFER_TOKEN_LEN {
            return Err(WorkerError::InvalidRequest(format!(
                "a decode request without a prompt needs the router's transfer_token (at least {MIN_TRANSFER_TOKEN_LEN} characters; got {})",
                req.transfer_token.len()
            )));
        }
        let prompt = req.prompt_tokens as usize;
        if prompt == 0 || prompt >= facts.max_context {
            return Err(WorkerError::InvalidRequest(format!(
                "prompt of {prompt} tokens: must be between 1 and {} (the model's context)",
                facts.max_context - 1
            )));
        }
        let params = ferry_proto::checked_sampling(req.sampling.as_ref(), req.stop.as_ref())?;
        let ids = if req.prompt.is_empty() { &req.prompt_ids } else { &req.prompt };
        if params.processes_logits() && ids.len() != prompt {
            return Err(WorkerError::InvalidRequest(format!(
                "penalties, logit_bias, min_tokens and bad_words read the whole sequence: send the prompt's ids in prompt_ids (got {} of {prompt})",
                ids.len()
            )));
        }
        let rules = rules_for(facts, &params, ids).await?;
        let bs = facts.layout.block_size;
        // Every choice's tokens, the prompt's full blocks counted once (they are shared).
        let need = u64::from(ferry_core::routing::blocks_needed(prompt, params.max_tokens, params.n, facts.max_context, bs as u32));
        let reservation = self.engine.load.try_reserve(need).ok_or_else(|| {
            WorkerError::Exhausted(format!(
                "needs {need} KV blocks; {} of {} are promised to running requests",
                self.engine.load.blocks_committed.load(Relaxed),
                self.engine.load.blocks_total.load(Relaxed)
            ))
        })?;
        // The caller may ask for less time than this worker's `--kv-timeout`, never more: an
        // admission holds KV blocks until its KV comes.
        let timeout = if req.kv_timeout_ms == 0 { self.kv_timeout } else { Duration::from_millis(req.kv_timeout_ms as u64).min(self.kv_timeout) };
        Ok(Admit { params, reservation, timeout, rules })
    }
}

/// What [`DecodeService::admit`] settled for a request.
struct Admit {
    params: SamplingParams,
    reservation: Reservation,
    timeout: Duration,
    rules: Rules,
}

/// Wait for an admitted request's KV (or its timeout, or the router going away), import it, and
/// answer the sender. None when the request ended (its error already sent on `tx`).
async fn receive_kv(
    engine: &DecodeHandle,
    receiver: &KvReceiver,
    mut ticket: Ticket,
    timeout: Duration,
    tx: &mpsc::Sender<std::result::Result<DecodeResponse, Status>>,
    mut admission: Admission,
    onto: Option<HeldPrefix>,
    ids: Vec<u32>,
) -> Option<mpsc::UnboundedReceiver<DecodeEvent>> {
    let delivery = tokio::select! {
        r = tokio::time::timeout(timeout, &mut ticket.rx) => r,
        _ = tx.closed() => return None,
    };
    let fail = |status: Status| async move {
        let _ = tx.send(Err(status)).await;
        None
    };
    let delivery: Delivery = match delivery {
        Ok(Ok(Ok(d))) => d,
        Ok(Ok(Err(status))) => return fail(status).await,
        Ok(Err(_)) => {
            let status = Status::aborted("the KV transfer was abandoned by its sender");
            return fail(crate::error::tagged(status, ferry_core::failure::WorkerFault::Transfer)).await;
        }
        Err(_) => {
            let e = WorkerError::Timeout { id: ticket.id, ms: timeout.as_millis() as u64, what: "the KV" };
            tracing::warn!(transfer = ticket.id, "{e}: the request's KV reservation is released");
            return fail(e.into()).await;
        }
    };
    drop(ticket);
    let (ev_tx, ev_rx) = mpsc::unbounded_channel();
    let (imp_tx, imp_rx) = oneshot::channel();
    let Delivery { assembled, ack } = delivery;
    // Importing the KV into the engine: a child of the prefill worker's `kv_send` (its context came
    // in `KvBegin`), so the trace follows the KV from prefill to decode.
    let import = tracing::info_span!("kv_import", bytes = assembled.payload.len(), chunks = assembled.chunks);
    ferry_proto::trace::Parent::from_traceparent(&assembled.traceparent).adopt(&import);
    // The wire's end of the KV, as the engine thread takes it: each choice's first token.
    let end = &assembled.end;
    let first = FirstToken { token: end.first_token, is_stop: end.first_is_stop, sampler_state: end.sampler_state };
    let more = end.more_choices.iter().map(|f| FirstToken { token: f.token, is_stop: f.is_stop, sampler_state: f.sampler_state });
    let firsts = std::iter::once(first).chain(more).collect();
    // The payload's token ids (after the prefix held here), when the router sent the prompt's.
    let cached = onto.as_ref().map_or(0, |h| h.cached);
    let tokens = (!ids.is_empty()).then(|| ids[cached..].to_vec());
    admission.source = Source::Kv { payload: assembled.payload, device: assembled.device, firsts, onto, tokens, context: ids, imported: imp_tx };
    admission.events = ev_tx;
    let imported = match engine.admit(admission) {
        Ok(()) => match imp_rx.instrument(import).await {
            Ok((r, buf)) => {
                receiver.buffers.give(buf);
                r.map_err(Status::from)
            }
            Err(_) => Err(WorkerError::EngineFailed("the decode engine stopped before importing the KV".into()).status()),
        },
        Err(e) => Err(e.into()),
    };
    let _ = ack.send(imported.as_ref().map(|_| ()).map_err(Status::clone));
    match imported {
        Ok(()) => Some(ev_rx),
        Err(status) => fail(status).await,
    }
}

#[tonic::async_trait]
impl ferry_proto::v1::decode_server::Decode for DecodeService {
    type DecodeStream = EventStream;

    async fn decode(&self, req: Request<DecodeRequest>) -> std::result::Result<Response<EventStream>, Status> {
        // The request's span here lasts as long as its stream; the router's call is its parent.
        let span = tracing::info_span!(
            "decode", request_id = %req.get_ref().request_id, worker = %self.name, prompt_tokens = req.get_ref().prompt_tokens,
            completion_tokens = tracing::field::Empty
        );
        ferry_proto::trace::Parent::from_headers(req.metadata().as_ref()).adopt(&span);
        // Until the stream is answered: checks, the reservation, the cached prefix.
        let admission_span = tracing::info_span!(parent: &span, "decode_admission");
        let req = req.into_inner();
        let role = self.engine.scheduling.role().as_str();
        let admitted = match self.drain.begin() {
            Ok(w) => self.admit(&req).instrument(admission_span.clone()).await.map(|a| (a, w)),
            Err(e) => Err(e),
        };
        let (Admit { params, reservation, timeout, rules }, work) = admitted.map_err(|e| {
            metrics::counter!(crate::cluster::metrics::names::REQUESTS, "role" => role, "outcome" => "refused").increment(1);
            tracing::info!(request_id = %req.request_id, worker = %self.name, "refused: {e}");
            Status::from(e)
        })?;
        let (tx, rx) = mpsc::channel(64);
        let engine = self.engine.clone();
        let receiver = self.receiver.clone();
        let request_id = req.request_id.clone();
        let prompt_tokens = req.prompt_tokens as usize;
        let prompt_logprobs = params.prompt_logprobs.is_some();
        let choices = params.n.max(1);
        let (placeholder, _) = mpsc::unbounded_channel();
        let admission = Admission { request_id: request_id.clone(), source: Source::Prompt { prompt: Vec::new(), held: None }, params, prompt_tokens, events: placeholder, reservation, rules };
        // The prompt's ids, when the router sent them: a colocated prompt, or a disaggregated
        // request's (for this worker's prefix cache).
        let colocated = !req.prompt.is_empty();
        let ids = if colocated { req.prompt } else { req.prompt_ids };
        // Attach the longest cached prefix (whole blocks; at least the last token is left to
        // compute, so the first token has logits wherever the rest is computed). A colocated
        // prompt whose logprobs are asked for is computed whole: nothing attached.
        let whole = colocated && prompt_logprobs;
        let held = match ids.is_empty() || !self.engine.facts.prefix_cache || whole {
            true => None,
            false => match engine.attach(ids.clone(), req.cache_salt.to_vec(), ids.len() - 1).instrument(admission_span.clone()).await {
                Ok(h) => Some(h),
                Err(e) => return Err(e.into()),
            },
        };
        let cached = held.as_ref().map_or(0, |h| h.cached);
        // Prompt logprobs come from a whole computation: never a local suffix after the prefix
        // (a prefill worker computes it all; this worker's prefix still saves shipping).
        let local_max = if prompt_logprobs { 0 } else { req.local_prefill_max as usize };
        // This worker's queued prompts, running sequences and measured pace at prompts, against
        // the router's estimate for a prefill worker: a suffix is computed here only if that adds
        // no more delay in all (`TurnTimes::local_cost`).
        let load = &self.engine.load;
        let remote = req.remote_prefill_ms;
        let times = TurnTimes {
            local_tokens_per_s: load.prefill_rate(),
            local_queued: load.queued_prefill_tokens.load(Relaxed) as usize,
            local_running: load.active_sequences.load(Relaxed) as usize,
            remote_seconds: (remote.is_finite() && remote > 0.0).then(|| remote / 1e3),
        };
        let plan = Plan::of(colocated, ids.len(), cached, local_max, self.engine.facts.layout.block_size, times);
        if !colocated && cached > 0 {
            tracing::debug!(request_id = %req.request_id, ?plan, cached, prompt_tokens = ids.len(), local_queued = times.local_queued, running = times.local_running, local_s = ?times.local_cost(ids.len() - cached), remote_s = ?times.remote_seconds, "where the prompt's suffix is computed");
        }
        let layout = &self.engine.facts.layout;
        let not_shipped = match plan {
            Plan::Receive => layout.layer_bytes(cached) * layout.n_layers,
            Plan::Local => layout.layer_bytes(ids.len()) * layout.n_layers,
            Plan::Colocated => 0,
        };
        if not_shipped > 0 {
            metrics::counter!(crate::cluster::metrics::names::KV_BYTES_NOT_SHIPPED).increment(not_shipped as u64);
        }
        // Receive: the KV comes from a prefill worker (only the part after the cached prefix).
        let ticket = match plan {
            Plan::Receive => {
                let ticket = self.receiver.expect_from(prompt_tokens, cached, req.transfer_token.clone());
                let admitted = Admitted { transfer_id: ticket.id, data_addr: self.data_addr.clone(), cached_tokens: cached as u32, local: false };
                tx.try_send(Ok(event(decode_response::Event::Admitted(admitted)))).expect("fresh channel has room");
                Some(ticket)
            }
            Plan::Local | Plan::Colocated => {
                let admitted = Admitted { cached_tokens: cached as u32, local: plan == Plan::Local, ..Default::default() };
                tx.try_send(Ok(event(decode_response::Event::Admitted(admitted)))).expect("fresh channel has room");
                None
            }
        };
        if cached > 0 {
            tracing::info!(request_id = %request_id, cached, prompt_tokens, plan = ?plan, "prompt prefix cached here");
        }
        tokio::spawn(async move {
            let _work = work;
            let t0 = Instant::now();
            let mut ev_rx = match ticket {
                Some(ticket) => {
                    match receive_kv(&engine, &receiver, ticket, timeout, &tx, admission, held, ids).instrument(tracing::info_span!("kv_receive")).await {
                        Some(rx) => rx,
                        None => return,
                    }
                }
                None => {
                    let (ev_tx, ev_rx) = mpsc::unbounded_channel();
                    let admission = Admission { source: Source::Prompt { prompt: ids, held }, events: ev_tx, ..admission };
                    if let Err(e) = engine.admit(admission) {
                        let _ = tx.send(Err(e.into())).await;
                        return;
                    }
                    ev_rx
                }
            };
            let kv_wait = t0.elapsed();
            let t1 = Instant::now();
            let mut ended = 0;
            loop {
                tokio::select! {
                    ev = ev_rx.recv() => match ev {
                        Some(DecodeEvent::Token { choice, token, logprob }) => {
                            let logprobs = logprob.iter().map(ferry_proto::logprob_to_wire).collect();
                            if tx.send(Ok(event(decode_response::Event::Tokens(DecodeTokens { ids: vec![token], logprobs, choice })))).await.is_err() {
                                return;
                            }
                        }
                        Some(DecodeEvent::PromptLogprobs(lps)) => {
                            let logprobs = lps.iter().map(ferry_proto::logprob_to_wire).collect();
                            if tx.send(Ok(event(decode_response::Event::PromptLogprobs(PromptLogprobs { logprobs })))).await.is_err() {
                                return;
                            }
                        }
                        Some(DecodeEvent::Finished { choice, reason, completion_tokens, spec: (proposed, accepted) }) => {
                            let fin = DecodeFinal {
                                finish_reason: finish_to_wire(reason) as i32,
                                completion_tokens,
                                kv_wait_ms: kv_wait.as_secs_f64() * 1e3,
                                decode_ms: t1.elapsed().as_secs_f64() * 1e3,
                                choice,
                                spec_proposed_tokens: proposed,
                                spec_accepted_tokens: accepted,
                            };
                            ended += 1;
                            if ended < choices {
                                if tx.send(Ok(event(decode_response::Event::Final(fin)))).await.is_err() {
                                    return;
                                }
                                continue;
                            }
                            metrics::counter!(crate::cluster::metrics::names::REQUESTS, "role" => role, "outcome" => "ok").increment(1);
                            tracing::Span::current().record("completion_tokens", completion_tokens);
                            tracing::info!(
                                request_id = %request_id, choices, completion_tokens, finish = ?reason,
                                kv_wait_ms = fin.kv_wait_ms, decode_ms = fin.decode_ms,
                                spec_proposed = proposed, spec_accepted = accepted, "decoded"
                            );
                            let _ = tx.send(Ok(event(decode_response::Event::Final(fin)))).await;
                            return;
                        }
                        Some(DecodeEvent::Failed(e)) => {
                            metrics::counter!(crate::cluster::metrics::names::REQUESTS, "role" => role, "outcome" => "error").increment(1);
                            tracing::warn!(request_id = %request_id, "failed: {e}");
                            let _ = tx.send(Err(e.into())).await;
                            return;
                        }
                        None => {
                            let e = WorkerError::EngineFailed("the engine thread stopped".into());
                            let _ = tx.send(Err(e.into())).await;
                            return;
                        }
                    },
                    // The router went away: dropping `ev_rx` makes the engine free the sequence.
                    _ = tx.closed() => {
                        metrics::counter!(crate::cluster::metrics::names::REQUESTS, "role" => role, "outcome" => "cancelled").increment(1);
                        tracing::info!(request_id = %request_id, "cancelled by the router");
                        return;
                    }
                }
            }
        }.instrument(span));
        drop(admission_span);
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }
}
