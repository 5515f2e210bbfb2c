//! The decode worker: admits a request only if its KV cache can hold prompt + max_tokens,
//! waits for the KV (with a timeout), imports it, and generates with continuous batching: one
//! engine thread steps every running sequence each iteration, and sequences join and leave
//! between steps (Orca, OSDI '22).

use crate::kv::receiver::{Delivery, KvReceiver};
use crate::load::{LoadGauge, Reservation};
use crate::prefill::ModelFacts;
use crate::{Result, WorkerError};
use ferry_core::{BlockTable, SamplingParams};
use ferry_engine::sampler::Sampler;
use ferry_engine::{Engine, FinishReason, Logits, SeqId, StepItem};
use ferry_proto::v1::{decode_response, Admitted, DecodeFinal, DecodeRequest, DecodeResponse, DecodeTokens, KvEnd};
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

pub enum DecodeEvent {
    Token(u32),
    Finished { reason: FinishReason, completion_tokens: u32 },
    Failed(String),
}

/// A request whose KV has arrived, handed to the engine thread.
pub struct Admission {
    pub request_id: String,
    pub payload: Vec<u8>,
    pub end: KvEnd,
    pub params: SamplingParams,
    pub prompt_tokens: usize,
    pub events: mpsc::UnboundedSender<DecodeEvent>,
    /// The import's outcome, and the payload buffer back for recycling.
    pub imported: oneshot::Sender<(std::result::Result<(), Status>, Vec<u8>)>,
    pub reservation: Reservation,
}

struct Running {
    seq: SeqId,
    sampler: Sampler,
    stop_ids: Vec<u32>,
    count: usize,
    last: u32,
    prompt_tokens: usize,
    max_tokens: usize,
    events: mpsc::UnboundedSender<DecodeEvent>,
    _reservation: Reservation,
}

#[derive(Clone)]
pub struct DecodeHandle {
    tx: std_mpsc::Sender<Admission>,
    pub load: Arc<LoadGauge>,
    pub facts: ModelFacts,
}

pub fn spawn(engine: Engine, model: String) -> DecodeHandle {
    let (tx, rx) = std_mpsc::channel();
    let load = Arc::new(LoadGauge::default());
    load.blocks_total.store(engine.total_blocks() as u64, Relaxed);
    load.blocks_free.store(engine.free_blocks() as u64, Relaxed);
    load.block_size.store(engine.kv_layout().block_size as u64, Relaxed);
    let facts = ModelFacts::of(&engine, model);
    let handle = DecodeHandle { tx, load: load.clone(), facts };
    std::thread::Builder::new().name("ferry-decode".into()).spawn(move || run(engine, rx, load)).expect("spawn the decode engine thread");
    handle
}

fn run(mut engine: Engine, rx: std_mpsc::Receiver<Admission>, load: Arc<LoadGauge>) {
    let mut running: Vec<Running> = Vec::new();
    let cap = engine.max_batch_tokens().max(1);
    let mut rotate = 0usize;
    loop {
        load.blocks_free.store(engine.free_blocks() as u64, Relaxed);
        load.active_sequences.store(running.len() as u64, Relaxed);
        load.export("decode");
        if running.is_empty() {
            match rx.recv() {
                Ok(a) => admit(&mut engine, &mut running, a),
                Err(_) => return,
            }
        }
        while let Ok(a) = rx.try_recv() {
            admit(&mut engine, &mut running, a);
        }
        // Cancelled requests (their stream was dropped) leave now.
        running.retain(|r| {
            let keep = !r.events.is_closed();
            if !keep {
                let _ = engine.release(r.seq);
            }
            keep
        });
        if running.is_empty() {
            continue;
        }
        // Everyone steps each iteration unless the batch exceeds the token budget; then rotate.
        let n = running.len().min(cap);
        let start = if n < running.len() { rotate % running.len() } else { 0 };
        rotate = rotate.wrapping_add(n);
        let idx: Vec<usize> = (0..n).map(|k| (start + k) % running.len()).collect();
        let toks: Vec<[u32; 1]> = idx.iter().map(|&i| [running[i].last]).collect();
        let items: Vec<StepItem> =
            idx.iter().zip(&toks).map(|(&i, t)| StepItem { seq: running[i].seq, tokens: t, logits: Logits::Last }).collect();
        let t0 = Instant::now();
        let result = engine.step(&items, &mut |_, _| {});
        drop(items);
        metrics::histogram!("ferry_worker_step_seconds", "role" => "decode").record(t0.elapsed().as_secs_f64());
        metrics::histogram!("ferry_worker_decode_batch").record(n as f64);
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("decode step failed: {e}");
                for r in running.drain(..) {
                    let _ = engine.release(r.seq);
                    let _ = r.events.send(DecodeEvent::Failed(format!("decode step failed: {e}")));
                }
                continue;
            }
        };
        let ctx = engine.config().max_position;
        let mut finished = Vec::new();
        for (&i, logits) in idx.iter().zip(logits) {
            let r = &mut running[i];
            let tok = r.sampler.sample(&logits);
            if let Some(reason) = advance(r, tok, ctx) {
                finished.push((i, reason));
            }
        }
        finished.sort_by_key(|f| std::cmp::Reverse(f.0));
        for (i, reason) in finished {
            let r = running.swap_remove(i);
            let _ = engine.release(r.seq);
            let _ = r.events.send(DecodeEvent::Finished { reason, completion_tokens: r.count as u32 });
        }
    }
}

/// Account for a newly sampled token; Some(reason) when the sequence is finished.
fn advance(r: &mut Running, tok: u32, ctx: usize) -> Option<FinishReason> {
    if r.stop_ids.contains(&tok) {
        return Some(FinishReason::StopToken(tok));
    }
    r.count += 1;
    r.last = tok;
    let _ = r.events.send(DecodeEvent::Token(tok));
    if r.count >= r.max_tokens {
        Some(FinishReason::Length)
    } else if r.prompt_tokens + r.count >= ctx {
        Some(FinishReason::ContextFull)
    } else {
        None
    }
}

fn admit(engine: &mut Engine, running: &mut Vec<Running>, a: Admission) {
    let seq = match engine.import_kv(&a.payload) {
        Ok(seq) => seq,
        Err(e) => {
            let _ = a.imported.send((Err(Status::from(WorkerError::from(e))), a.payload));
            return;
        }
    };
    if a.imported.send((Ok(()), a.payload)).is_err() {
        let _ = engine.release(seq);
        return;
    }
    let mut r = Running {
        seq,
        sampler: Sampler::resume(&a.params, a.end.sampler_state),
        stop_ids: engine.stop_ids(&a.params),
        count: 0,
        last: a.end.first_token,
        prompt_tokens: a.prompt_tokens,
        max_tokens: a.params.max_tokens,
        events: a.events,
        _reservation: a.reservation,
    };
    // The first token was sampled by the prefill worker; it counts like any other (but the
    // router already streamed it, so `advance` must not send it again).
    let first = a.end.first_token;
    let finish = if a.end.first_is_stop {
        Some(FinishReason::StopToken(first))
    } else {
        r.count = 1;
        if r.count >= r.max_tokens {
            Some(FinishReason::Length)
        } else if r.prompt_tokens + r.count >= engine.config().max_position {
            Some(FinishReason::ContextFull)
        } else {
            None
        }
    };
    match finish {
        Some(reason) => {
            let _ = engine.release(seq);
            let _ = r.events.send(DecodeEvent::Finished { reason, completion_tokens: r.count as u32 });
        }
        None => {
            tracing::debug!(request_id = %a.request_id, "joined the running batch");
            running.push(r);
        }
    }
}

impl DecodeHandle {
    fn admit(&self, a: Admission) -> Result<()> {
        self.tx.send(a).map_err(|_| WorkerError::ShuttingDown)
    }
}

/// The gRPC `Decode` service.
pub struct DecodeService {
    pub engine: DecodeHandle,
    pub receiver: Arc<KvReceiver>,
    /// The TCP data path's address, offered to senders (empty: gRPC only).
    pub data_addr: String,
    pub kv_timeout: Duration,
    pub name: String,
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
    fn admit(&self, req: &DecodeRequest) -> Result<(SamplingParams, Reservation, Duration)> {
        let facts = &self.engine.facts;
        let prompt = req.prompt_tokens as usize;
        if prompt == 0 || prompt >= facts.max_context {
            return Err(WorkerError::InvalidRequest(format!(
                "prompt of {prompt} tokens: must be between 1 and {} (the model's context)",
                facts.max_context - 1
            )));
        }
        let params = ferry_proto::sampling_from_wire(req.sampling.as_ref(), req.stop.as_ref());
        params.validate()?;
        let bs = facts.layout.block_size;
        let need = BlockTable::blocks_for((prompt + params.max_tokens).min(facts.max_context), bs) as u64;
        let reservation = self.engine.load.try_reserve(need).ok_or_else(|| {
            WorkerError::Exhausted(format!(
                "needs {need} KV blocks; {} of {} are promised to running requests",
                self.engine.load.blocks_committed.load(Relaxed),
                self.engine.load.blocks_total.load(Relaxed)
            ))
        })?;
        let timeout = if req.kv_timeout_ms == 0 { self.kv_timeout } else { Duration::from_millis(req.kv_timeout_ms as u64) };
        Ok((params, reservation, timeout))
    }
}

#[tonic::async_trait]
impl ferry_proto::v1::decode_server::Decode for DecodeService {
    type DecodeStream = EventStream;

    async fn decode(&self, req: Request<DecodeRequest>) -> std::result::Result<Response<EventStream>, Status> {
        let req = req.into_inner();
        let (params, reservation, timeout) = self.admit(&req).map_err(|e| {
            metrics::counter!("ferry_worker_requests_total", "role" => "decode", "outcome" => "refused").increment(1);
            tracing::info!(request_id = %req.request_id, worker = %self.name, "decode refused: {e}");
            Status::from(e)
        })?;
        let mut ticket = self.receiver.expect(req.prompt_tokens as usize);
        let (tx, rx) = mpsc::channel(64);
        let admitted = Admitted { transfer_id: ticket.id, transfer_token: ticket.token.clone(), data_addr: self.data_addr.clone() };
        tx.try_send(Ok(event(decode_response::Event::Admitted(admitted)))).expect("fresh channel has room");
        let engine = self.engine.clone();
        let receiver = self.receiver.clone();
        let request_id = req.request_id.clone();
        let prompt_tokens = req.prompt_tokens as usize;
        tokio::spawn(async move {
            let t0 = Instant::now();
            let delivery = tokio::select! {
                r = tokio::time::timeout(timeout, &mut ticket.rx) => r,
                _ = tx.closed() => return,
            };
            let delivery: Delivery = match delivery {
                Ok(Ok(Ok(d))) => d,
                Ok(Ok(Err(status))) => {
                    let _ = tx.send(Err(status)).await;
                    return;
                }
                Ok(Err(_)) => {
                    let _ = tx.send(Err(Status::aborted("the KV transfer was abandoned by its sender"))).await;
                    return;
                }
                Err(_) => {
                    let e = WorkerError::Timeout { id: ticket.id, ms: timeout.as_millis() as u64, what: "the KV" };
                    let _ = tx.send(Err(e.into())).await;
                    return;
                }
            };
            drop(ticket);
            let kv_wait = t0.elapsed();
            let (ev_tx, mut ev_rx) = mpsc::unbounded_channel();
            let (imp_tx, imp_rx) = oneshot::channel();
            let Delivery { assembled, ack } = delivery;
            let admission = Admission {
                request_id: request_id.clone(),
                payload: assembled.payload,
                end: assembled.end,
                params,
                prompt_tokens,
                events: ev_tx,
                imported: imp_tx,
                reservation,
            };
            let imported = match engine.admit(admission) {
                Ok(()) => match imp_rx.await {
                    Ok((r, buf)) => {
                        receiver.buffers.give(buf);
                        r
                    }
                    Err(_) => Err(Status::unavailable("the decode engine stopped")),
                },
                Err(e) => Err(e.into()),
            };
            let _ = ack.send(imported.as_ref().map(|_| ()).map_err(|s| Status::new(s.code(), s.message())));
            if let Err(status) = imported {
                let _ = tx.send(Err(status)).await;
                return;
            }
            let t1 = Instant::now();
            loop {
                tokio::select! {
                    ev = ev_rx.recv() => match ev {
                        Some(DecodeEvent::Token(t)) => {
                            if tx.send(Ok(event(decode_response::Event::Tokens(DecodeTokens { ids: vec![t] })))).await.is_err() {
                                return;
                            }
                        }
                        Some(DecodeEvent::Finished { reason, completion_tokens }) => {
                            let fin = DecodeFinal {
                                finish_reason: finish_to_wire(reason) as i32,
                                completion_tokens,
                                kv_wait_ms: kv_wait.as_secs_f64() * 1e3,
                                decode_ms: t1.elapsed().as_secs_f64() * 1e3,
                            };
                            metrics::counter!("ferry_worker_requests_total", "role" => "decode", "outcome" => "ok").increment(1);
                            tracing::info!(
                                request_id = %request_id, completion_tokens, finish = ?reason,
                                kv_wait_ms = fin.kv_wait_ms, decode_ms = fin.decode_ms, "decoded"
                            );
                            let _ = tx.send(Ok(event(decode_response::Event::Final(fin)))).await;
                            return;
                        }
                        Some(DecodeEvent::Failed(msg)) => {
                            let _ = tx.send(Err(Status::internal(msg))).await;
                            return;
                        }
                        None => {
                            let _ = tx.send(Err(Status::unavailable("the decode engine stopped"))).await;
                            return;
                        }
                    },
                    // The router went away: dropping `ev_rx` makes the engine free the sequence.
                    _ = tx.closed() => {
                        metrics::counter!("ferry_worker_requests_total", "role" => "decode", "outcome" => "cancelled").increment(1);
                        tracing::info!(request_id = %request_id, "cancelled by the router");
                        return;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }
}
