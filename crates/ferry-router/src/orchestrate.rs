//! One request's life on the cluster (the lifecycle in `proto/ferry/v1/worker.proto`):
//! admission on a decode worker, prefill with that KV target, then the decode stream relayed to
//! the client. Text is detokenized and stop strings applied here, exactly as the engine's
//! `generate_seq` does locally. Dropping a worker call (client gone, stop string, error) cancels
//! the request on that worker; in-flight counts are held by guards.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_core::routing::{blocks_needed, pick_prefill, rank_decode};
use ferry_core::{SamplingParams, StopMatcher, WorkerRole, WorkerState};
use ferry_proto::v1::{self, decode_response::Event as DecodeEvent, generate_response::Event};
use ferry_tokenizer::StreamDecoder;
use tokio::sync::mpsc;
use tonic::{Code, Status, Streaming};

use crate::RouterError;
use crate::registry::{InflightGuard, MAX_MESSAGE_BYTES, Worker};
use crate::service::Shared;

type Tx = mpsc::Sender<Result<v1::GenerateResponse, Status>>;

/// A validated request.
pub struct Job {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
    pub start: Instant,
}

enum Outcome {
    Done,
    ClientGone,
}

/// A failed attempt: `retry` when nothing reached the client and another worker may succeed.
struct Failed {
    error: RouterError,
    retry: bool,
}

impl From<RouterError> for Failed {
    fn from(error: RouterError) -> Failed {
        Failed {
            error,
            retry: false,
        }
    }
}

/// Transport-level failures (connection refused or reset, worker gone) come back as UNAVAILABLE.
fn is_transport(s: &Status) -> bool {
    s.code() == Code::Unavailable
}

/// A worker's refusal because it is draining (UNAVAILABLE with `ferry-refusal: draining`): it is
/// alive, just leaving. Another worker takes the request; this one is not marked dead.
fn is_draining(s: &Status) -> bool {
    s.metadata()
        .get("ferry-refusal")
        .is_some_and(|v| v.as_bytes() == b"draining")
}

/// Whether something still accepts TCP connections at `addr` (a quick liveness probe).
async fn reachable(addr: &str) -> bool {
    let addr = addr
        .trim_start_matches("http://")
        .trim_start_matches("https://");
    matches!(
        tokio::time::timeout(
            std::time::Duration::from_millis(300),
            tokio::net::TcpStream::connect(addr)
        )
        .await,
        Ok(Ok(_))
    )
}

/// Whether a failed call means the worker is gone: UNAVAILABLE, or a broken connection (a
/// killed worker's HTTP/2 stream often ends as UNKNOWN, INTERNAL or CANCELLED) to an address
/// that no longer accepts connections.
///
/// A false positive is cheap: a live worker marked dead gets NOT_FOUND on its next heartbeat and
/// registers again within a second.
async fn gone(s: &Status, addr: &str) -> bool {
    if is_transport(s) {
        return true;
    }
    if !matches!(s.code(), Code::Unknown | Code::Internal | Code::Cancelled) {
        return false;
    }
    // A dying process's listening socket can still complete a TCP handshake for a moment, so a
    // broken connection says more than the probe.
    let m = s.message().to_ascii_lowercase();
    [
        "h2 protocol error",
        "transport error",
        "connection",
        "broken pipe",
    ]
    .iter()
    .any(|k| m.contains(k))
        || !reachable(addr).await
}

/// Runs one request to its end, sending deltas, then a final or an error status, on `tx`.
pub async fn run(shared: Arc<Shared>, job: Job, tx: Tx) {
    let _inflight = crate::metrics::InflightGauge::new();
    let mut attempt = 0;
    // Workers that failed this request are not tried again for it.
    let mut avoid = Vec::new();
    let result = loop {
        match attempt_once(&shared, &job, &tx, &mut avoid).await {
            Err(f) if f.retry && attempt < shared.cfg.max_retries => {
                tracing::warn!(error = %f.error, attempt, "retrying on other workers");
                metrics::counter!("ferry_router_retries_total").increment(1);
                attempt += 1;
            }
            Err(f) => break Err(f.error),
            Ok(o) => break Ok(o),
        }
    };
    match result {
        Ok(Outcome::Done) => crate::metrics::request_outcome("ok"),
        Ok(Outcome::ClientGone) => {
            tracing::info!("client went away: request cancelled");
            crate::metrics::request_outcome("cancelled");
        }
        Err(e) => {
            tracing::warn!(error = %e, "request failed");
            let status = Status::from(e);
            crate::metrics::request_outcome(crate::metrics::outcome_of(status.code()));
            let _ = tx.send(Err(status)).await;
        }
    }
}

/// Awaits a worker call unless the client goes away first (`None`); adds the wait to `waited`.
async fn worker_wait<T>(tx: &Tx, waited: &mut Duration, fut: impl Future<Output = T>) -> Option<T> {
    let t = Instant::now();
    let r = tokio::select! {
        r = fut => Some(r),
        _ = tx.closed() => None,
    };
    *waited += t.elapsed();
    r
}

async fn open_decode(
    w: &Worker,
    req: v1::DecodeRequest,
) -> Result<(Streaming<v1::DecodeResponse>, v1::Admitted), Status> {
    let mut client = v1::decode_client::DecodeClient::new(w.channel.clone())
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let mut stream = client.decode(req).await?.into_inner();
    match stream.message().await? {
        Some(v1::DecodeResponse {
            event: Some(DecodeEvent::Admitted(a)),
        }) => Ok((stream, a)),
        other => Err(Status::internal(format!(
            "expected `admitted` first, got {other:?}"
        ))),
    }
}

async fn attempt_once(
    shared: &Arc<Shared>,
    job: &Job,
    tx: &Tx,
    avoid: &mut Vec<String>,
) -> Result<Outcome, Failed> {
    let reg = &shared.registry;
    let rid = &job.request_id;
    let mut waited = Duration::ZERO;
    let (sampling, stop) = ferry_proto::sampling_to_wire(&job.params);

    // Colocated workers, when there are any, serve the request alone (prefill included).
    let colocated = reg.ready_counts().2 > 0;
    let decode_role = if colocated {
        WorkerRole::Colocated
    } else {
        WorkerRole::Decode
    };

    // 1. Admission on the decode (or colocated) worker with the most room.
    let (mut cands, block_size) = reg.decode_candidates(decode_role);
    for c in cands.iter_mut().filter(|c| avoid.contains(&c.id)) {
        c.state = WorkerState::Dead;
    }
    let ctx = reg.max_context().unwrap_or(u32::MAX) as usize;
    let need = if block_size == 0 {
        0
    } else {
        blocks_needed(job.prompt.len(), job.params.max_tokens, ctx, block_size)
    };
    let order = rank_decode(&cands, need);
    if order.is_empty() && !cands.iter().any(|c| c.state == WorkerState::Ready) {
        return Err(RouterError::NoWorker { role: decode_role }.into());
    }
    let (mut refused, mut unavailable) = (0, 0);
    let mut admitted = None;
    // The decode worker accepts this attempt's KV only from a sender presenting this token, which
    // only the router and the chosen prefill worker ever see.
    let transfer_token = if colocated { String::new() } else { mint_transfer_token() };
    for i in order {
        let Some(w) = reg.get(&cands[i].id) else {
            continue;
        };
        let req = v1::DecodeRequest {
            request_id: rid.clone(),
            prompt_tokens: job.prompt.len() as u32,
            sampling: Some(sampling.clone()),
            stop: Some(stop.clone()),
            kv_timeout_ms: shared.cfg.kv_timeout.as_millis().min(u32::MAX as u128) as u32,
            prompt: if colocated {
                job.prompt.clone()
            } else {
                Vec::new()
            },
            transfer_token: transfer_token.clone(),
        };
        let guard = InflightGuard::decode(reg, &w.id, need as u64);
        let Some(r) = worker_wait(tx, &mut waited, open_decode(&w, req)).await else {
            return Ok(Outcome::ClientGone);
        };
        match r {
            Ok((stream, a)) => {
                admitted = Some((w, stream, a, guard));
                break;
            }
            Err(s) if s.code() == Code::ResourceExhausted => refused += 1,
            Err(s) if is_draining(&s) => {
                reg.mark_draining(&w.id);
                refused += 1;
            }
            Err(s) if gone(&s, &w.grpc_addr).await => {
                reg.mark_dead(&w.id, s.message());
                unavailable += 1;
            }
            Err(s) => return Err(worker_failed(WorkerRole::Decode, &w.id, rid, s).into()),
        }
    }
    let Some((dw, mut stream, adm, _decode_guard)) = admitted else {
        return Err(if unavailable > 0 && refused == 0 {
            RouterError::NoWorker {
                role: WorkerRole::Decode,
            }
        } else {
            RouterError::DecodeExhausted {
                need_blocks: need,
                tried: refused + unavailable,
            }
        }
        .into());
    };

    // 2. Prefill, pushing the KV to the admitted decode worker (a colocated worker prefills itself).
    let (prefill_worker, pre) = if colocated {
        (dw.id.clone(), None)
    } else {
        // A draining prefill worker refuses; the next one is tried (each at most once).
        loop {
            let mut pcands = reg.prefill_candidates();
            for c in pcands.iter_mut().filter(|c| avoid.contains(&c.id)) {
                c.state = WorkerState::Dead;
            }
            let pw = pick_prefill(&pcands, job.prompt.len()).and_then(|i| reg.get(&pcands[i].id));
            let Some(pw) = pw else {
                return Err(RouterError::NoWorker {
                    role: WorkerRole::Prefill,
                }
                .into());
            };
            let chosen = crate::transport::choose(shared.cfg.kv_transport, &pw.kv_transports, &dw.kv_transports);
            let preq = v1::PrefillRequest {
                request_id: rid.clone(),
                prompt: job.prompt.clone(),
                sampling: Some(sampling.clone()),
                stop: Some(stop.clone()),
                target: Some(v1::KvTarget {
                    decode_worker: dw.id.clone(),
                    grpc_addr: dw.grpc_addr.clone(),
                    data_addr: adm.data_addr.clone(),
                    transfer_id: adm.transfer_id,
                    transfer_token: transfer_token.clone(),
                    transport: chosen as i32,
                }),
            };
            let mut client = v1::prefill_client::PrefillClient::new(pw.channel.clone())
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES);
            let prefill_guard = InflightGuard::new(reg, &pw.id, job.prompt.len() as u64);
            let Some(r) = worker_wait(tx, &mut waited, client.prefill(preq)).await else {
                return Ok(Outcome::ClientGone);
            };
            drop(prefill_guard);
            let pre = match r {
                Ok(r) => r.into_inner(),
                Err(s) if is_draining(&s) => {
                    reg.mark_draining(&pw.id);
                    avoid.push(pw.id.clone());
                    continue;
                }
                // Nothing has reached the client yet, so any failure of the worker or its link is retried
                // elsewhere. ABORTED: the prefill worker could not deliver the KV to the decode worker.
                Err(s)
                    if matches!(
                        s.code(),
                        Code::Aborted
                            | Code::Unavailable
                            | Code::Unknown
                            | Code::Internal
                            | Code::Cancelled
                    ) =>
                {
                    let (role, worker) = if s.code() == Code::Aborted {
                        if !reachable(&dw.grpc_addr).await {
                            reg.mark_dead(&dw.id, s.message());
                        }
                        avoid.push(dw.id.clone());
                        (WorkerRole::Decode, dw.id.clone())
                    } else {
                        // A worker being killed may still accept connections for a moment: the lease
                        // catches it then, if this probe does not.
                        if gone(&s, &pw.grpc_addr).await {
                            reg.mark_dead(&pw.id, s.message());
                        }
                        avoid.push(pw.id.clone());
                        (WorkerRole::Prefill, pw.id.clone())
                    };
                    // Nothing reached the client: drop the decode stream (freeing its reservation) and retry.
                    let error = RouterError::WorkerUnavailable {
                        role,
                        worker,
                        request_id: rid.clone(),
                        message: s.message().to_owned(),
                    };
                    return Err(Failed { error, retry: true });
                }
                Err(s) => return Err(worker_failed(WorkerRole::Prefill, &pw.id, rid, s).into()),
            };
            crate::metrics::observe_kv_transport(chosen, pre.kv.as_ref());
            break (pw.id.clone(), Some(pre));
        }
    };
    let mut ttft = pre.as_ref().map(|_| job.start.elapsed());

    // 3. Relay: the first token from prefill, then the decode stream.
    let tok = &shared.text.tokenizer;
    let mut text = Relay {
        detok: StreamDecoder::new(tok, true),
        stops: StopMatcher::new(job.params.stop_strings.clone()),
    };
    let protocol = |message: String| RouterError::Protocol {
        worker: dw.id.clone(),
        request_id: rid.clone(),
        message,
    };
    let mut n = 0u32;
    let mut last_token = ttft.unwrap_or_default();
    let mut finish = None;
    let mut completion = None;
    match &pre {
        Some(pre) if pre.first_is_stop => finish = Some(v1::FinishReason::StopToken),
        Some(pre) => {
            n = 1;
            let (delta, stopped) = text.push(pre.first_token).map_err(protocol)?;
            if send_delta(tx, rid, delta, vec![pre.first_token])
                .await
                .is_err()
            {
                return Ok(Outcome::ClientGone);
            }
            if stopped {
                finish = Some(v1::FinishReason::StopString);
            }
        }
        // Colocated: the first token comes on the decode stream.
        None => {}
    }
    while finish.is_none() {
        let Some(m) = worker_wait(tx, &mut waited, stream.message()).await else {
            return Ok(Outcome::ClientGone);
        };
        match m {
            Ok(Some(v1::DecodeResponse {
                event: Some(DecodeEvent::Tokens(t)),
            })) => {
                last_token = job.start.elapsed();
                ttft.get_or_insert(last_token);
                let mut out = String::new();
                let mut ids = Vec::with_capacity(t.ids.len());
                for id in t.ids {
                    n += 1;
                    ids.push(id);
                    let (delta, stopped) = text.push(id).map_err(protocol)?;
                    out.push_str(&delta);
                    if stopped {
                        finish = Some(v1::FinishReason::StopString);
                        break;
                    }
                }
                if send_delta(tx, rid, out, ids).await.is_err() {
                    return Ok(Outcome::ClientGone);
                }
            }
            Ok(Some(v1::DecodeResponse {
                event: Some(DecodeEvent::Final(f)),
            })) => {
                finish = Some(
                    v1::FinishReason::try_from(f.finish_reason)
                        .unwrap_or(v1::FinishReason::Unspecified),
                );
                completion = Some(f.completion_tokens);
            }
            Ok(Some(other)) => return Err(protocol(format!("unexpected message {other:?}")).into()),
            Ok(None) => {
                return Err(protocol("the decode stream ended without `final`".into()).into());
            }
            Err(s) => {
                // A worker killed mid-stream shows up as a broken HTTP/2 stream (often UNKNOWN or
                // INTERNAL, not UNAVAILABLE): check whether it still accepts connections.
                if gone(&s, &dw.grpc_addr).await {
                    reg.mark_dead(&dw.id, s.message());
                }
                let error = RouterError::WorkerUnavailable {
                    role: WorkerRole::Decode,
                    worker: dw.id.clone(),
                    request_id: rid.clone(),
                    message: format!("{:?}: {}", s.code(), s.message()),
                };
                return Err(error.into());
            }
        }
    }
    // A stop string ends the request here: dropping the stream cancels it on the decode worker.
    drop(stream);
    let finish = finish.unwrap_or(v1::FinishReason::Unspecified);
    if finish != v1::FinishReason::StopString {
        let rest = text.flush().map_err(protocol)?;
        if !rest.is_empty() && send_delta(tx, rid, rest, vec![]).await.is_err() {
            return Ok(Outcome::ClientGone);
        }
    }
    let e2e = job.start.elapsed();
    let ttft = ttft.unwrap_or(e2e);
    let tpot = if n >= 2 {
        (last_token.saturating_sub(ttft)).as_secs_f64() / (n - 1) as f64
    } else {
        0.0
    };
    let kv = pre.and_then(|p| p.kv).unwrap_or_default();
    crate::metrics::observe_request(ttft, tpot, e2e, &kv, e2e.saturating_sub(waited));
    let fin = v1::GenerateFinal {
        finish_reason: finish as i32,
        prompt_tokens: job.prompt.len() as u32,
        completion_tokens: completion.unwrap_or(n),
        ttft_ms: ttft.as_secs_f64() * 1e3,
        tpot_ms: tpot * 1e3,
        e2e_ms: e2e.as_secs_f64() * 1e3,
        prefill_worker,
        decode_worker: dw.id.clone(),
        kv: Some(kv),
    };
    let msg = v1::GenerateResponse {
        request_id: rid.clone(),
        event: Some(Event::Final(fin)),
    };
    Ok(if tx.send(Ok(msg)).await.is_err() {
        Outcome::ClientGone
    } else {
        Outcome::Done
    })
}

fn worker_failed(role: WorkerRole, worker: &str, request_id: &str, s: Status) -> RouterError {
    RouterError::WorkerFailed {
        role,
        worker: worker.into(),
        request_id: request_id.into(),
        code: s.code(),
        message: s.message().into(),
    }
}

async fn send_delta(tx: &Tx, rid: &str, text: String, token_ids: Vec<u32>) -> Result<(), ()> {
    let msg = v1::GenerateResponse {
        request_id: rid.into(),
        event: Some(Event::Delta(v1::TokenDelta { text, token_ids })),
    };
    tx.send(Ok(msg)).await.map_err(|_| ())
}

/// Detokenizer plus stop matcher, as `Engine::generate_seq` chains them.
struct Relay<'a> {
    detok: StreamDecoder<'a>,
    stops: StopMatcher,
}

impl Relay<'_> {
    /// Text released by one more id, and whether it completed a stop string.
    fn push(&mut self, id: u32) -> Result<(String, bool), String> {
        match self.detok.push(id).map_err(|e| e.to_string())? {
            Some(delta) => {
                let r = self.stops.push(&delta);
                Ok((r.text, r.stopped))
            }
            None => Ok((String::new(), false)),
        }
    }

    /// What is held back when generation ends for a reason other than a stop string.
    fn flush(&mut self) -> Result<String, String> {
        let rest = self
            .detok
            .finish()
            .map_err(|e| e.to_string())?
            .unwrap_or_default();
        let r = self.stops.push(&rest);
        let mut text = r.text;
        if !r.stopped {
            text.push_str(&self.stops.finish());
        }
        Ok(text)
    }
}

/// 128 random bits as 32 hex characters, from the thread-local CSPRNG (ChaCha, seeded by the OS).
fn mint_transfer_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}
