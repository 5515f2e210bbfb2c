//! One request's life on the cluster (the lifecycle in `proto/ferry/v1/worker.proto`):
//! admission on a decode worker ([`admit`]), prefill with that KV target ([`prefill`]), then the
//! decode stream relayed to the client ([`relay`]). Every call is watched ([`call`]): a deadline,
//! the client, and the death of the workers it involves end it.
//!
//! When a call fails, `ferry_core::failure::classify` decides from the status alone: start again
//! elsewhere (nothing reached the client), **migrate** (tokens were streamed: the prompt plus
//! those tokens are prefilled again on other workers and the stream goes on, as Dynamo's request
//! migration does; the sampler's draws depend only on the seed and the token index, so greedy
//! and seeded requests continue exactly), wait in the admission queue for room, or end with the
//! error. Dropping a worker call (client gone, stop string, error) cancels the request on that
//! worker; in-flight counts are held by guards.
//!
//! A request with `n` choices runs as one group (one choice is a group of one): one admission
//! that reserves KV for every choice, one prefill that samples each choice's first token and
//! ships the prompt's KV once, one decode stream on which the decode worker runs the choices as
//! sequences sharing the prompt's KV blocks; each choice has its own [`Progress`], and every
//! delta and final names its choice. If a group's stream fails after tokens were streamed, each
//! unfinished choice continues alone as a one-choice request ([`alone`]).

mod admit;
mod call;
mod prefill;
mod relay;

use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_core::failure::{self, Blame, Decision, Phase, WorkerFault};
use ferry_core::{SamplingParams, WorkerRole};
use ferry_proto::v1::{self, generate_response::Event};
use tokio::sync::mpsc;
use tonic::Status;

use crate::RouterError;
use crate::queue::Place;
use crate::registry::Worker;
use crate::service::Shared;
use call::{Interrupt, reachable};

type Tx = mpsc::Sender<Result<v1::GenerateResponse, Status>>;

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
enum CutShort {
    ClientGone,
    Failed(Failed),
}

/// A failed attempt and what to do about it.
struct Failed {
    error: RouterError,
    decision: Decision,
}

impl From<Failed> for CutShort {
    fn from(f: Failed) -> CutShort {
        CutShort::Failed(f)
    }
}

impl Failed {
    fn fatal(error: RouterError) -> Failed {
        Failed { error, decision: Decision::Final }
    }
}

/// What the request (one choice of it, with `n` > 1) has done so far, across its attempts.
struct Progress<'a> {
    /// Which choice this is (0 unless `n` > 1): every delta and final names it.
    choice: u32,
    /// Its final was sent.
    done: bool,
    /// Detokenizer and stop strings: they run on across a migration.
    text: ferry_tokenizer::TextStream<'a>,
    /// Ids streamed to the client, in order.
    generated: Vec<u32>,
    /// Since the request started.
    ttft: Option<Duration>,
    last_token: Duration,
    retries: u32,
    migrations: u32,
    /// When the attempt that failed after tokens had been streamed failed (the start of the
    /// stall the client sees).
    fault_at: Option<Duration>,
    /// Time spent waiting on workers (the rest is the router's own overhead).
    waited: Duration,
    /// Workers that failed this request: not tried again for it.
    avoid: Vec<String>,
    /// The place in the admission queue, held until a decode worker admits the request.
    place: Option<Place>,
    /// The workers and KV transfer of the last attempt, for the summary.
    prefill_worker: String,
    decode_worker: String,
    kv: v1::KvTransferStats,
    /// Prompt tokens of the last attempt that a prefix cache served.
    cached_tokens: u32,
    /// The prompt's logprobs reached the client: later attempts do not ask for them again.
    prompt_logprobs_sent: bool,
}

impl<'a> Progress<'a> {
    fn new(shared: &'a Shared, params: &SamplingParams, choice: u32) -> Progress<'a> {
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
            prompt_logprobs_sent: false,
        }
    }

    fn phase(&self) -> Phase {
        if self.generated.is_empty() { Phase::BeforeFirstToken } else { Phase::Streaming }
    }

    /// The prompt and parameters of the next attempt: the tokens streamed so far join the
    /// prompt, and sampling continues at their index.
    fn resume(&self, job: &Job) -> (Vec<u32>, SamplingParams) {
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

    /// Records tokens sent to the client now.
    fn sent(&mut self, job: &Job, ids: &[u32]) {
        if ids.is_empty() {
            return;
        }
        let now = job.start.elapsed();
        if let Some(at) = self.fault_at.take() {
            metrics::histogram!("ferry_router_migration_stall_seconds").record(now.saturating_sub(at).as_secs_f64());
        }
        self.ttft.get_or_insert(now);
        self.last_token = now;
        self.generated.extend_from_slice(ids);
    }
}

/// Runs one request to its end, sending deltas, then a final or an error status, on `tx`.
pub async fn run(shared: Arc<Shared>, mut job: Job, tx: Tx) {
    let _inflight = crate::metrics::InflightGauge::new();
    // A sampled request without a seed gets one here, so that a migration continues its sample.
    if !job.params.is_greedy() && job.params.seed.is_none() {
        job.params.seed = Some(rand::random());
    }
    shared.window.arrived();
    // One choice is a group of one: every request runs the same attempts.
    let mut choices: Vec<Progress> = (0..job.params.n.max(1)).map(|i| Progress::new(&shared, &job.params, i)).collect();
    let result = drive(&shared, &job, &mut choices, &tx).await;
    // (ttft, last token, tokens) of a single-choice request, for the autoscaler's window.
    let timing = match choices.as_slice() {
        [one] => Some((one.ttft, one.last_token, one.generated.len())),
        _ => None,
    };
    let finished = |ok: bool| {
        let (ttft, last, n) = timing.unwrap_or((None, Duration::ZERO, 0));
        let ttft = ttft.unwrap_or_else(|| job.start.elapsed());
        let tpot = if n >= 2 { last.saturating_sub(ttft).as_secs_f64() / (n - 1) as f64 } else { 0.0 };
        crate::autoscale::Finished { prompt: job.prompt.len(), output: n, ttft_ms: ttft.as_secs_f64() * 1e3, tpot_ms: tpot * 1e3, ok }
    };
    match result {
        Ok(()) => {
            crate::metrics::request_outcome("ok");
            if timing.is_some() {
                shared.window.finished(finished(true));
            }
        }
        Err(CutShort::ClientGone) => {
            tracing::info!("client went away: request cancelled");
            crate::metrics::request_outcome("cancelled");
        }
        Err(CutShort::Failed(f)) => {
            shared.window.finished(finished(false));
            tracing::warn!(error = %f.error, "request failed");
            let status = Status::from(f.error);
            crate::metrics::request_outcome(crate::metrics::outcome_of(status.code()));
            let _ = tx.send(Err(status)).await;
        }
    }
}

/// Waits behind the requests already queued for room (they are not overtaken; the first
/// choice holds the place), then [`attempts`]; a group that split goes on [`alone`].
async fn drive(shared: &Arc<Shared>, job: &Job, choices: &mut [Progress<'_>], tx: &Tx) -> Result<(), CutShort> {
    if shared.queue.depth() > 0 {
        queue_wait(shared, &mut choices[0], tx).await?;
    }
    match attempts(shared, job, choices, tx).await? {
        Split::No => Ok(()),
        Split::After(f) => alone(shared, job, choices, tx, f).await,
    }
}

/// Whether a group of several choices split up ([`attempts`]).
enum Split {
    No,
    /// The group failed so, after reaching the client.
    After(Failed),
}

/// [`attempt`] until one ends the request, acting on each failure's decision (the first choice
/// keeps the counts). Once a group of several choices has reached the client (a token, or a
/// choice's end), it does not start over: it splits. A group of one never does.
async fn attempts(shared: &Arc<Shared>, job: &Job, choices: &mut [Progress<'_>], tx: &Tx) -> Result<Split, CutShort> {
    loop {
        let f = match attempt(shared, job, choices, tx).await {
            Ok(()) => return Ok(Split::No),
            Err(CutShort::ClientGone) => return Err(CutShort::ClientGone),
            Err(CutShort::Failed(f)) => f,
        };
        if choices.len() > 1 && choices.iter().any(|p| p.done || !p.generated.is_empty()) {
            return Ok(Split::After(f));
        }
        recover(shared, job, &mut choices[0], tx, f).await?;
    }
}

/// A group whose stream failed after reaching the client: each unfinished choice continues as
/// a one-choice request with its own seed (`SamplingParams::choice`), from the tokens it
/// streamed, exactly as a migrated request does; the choices run concurrently.
async fn alone(shared: &Arc<Shared>, job: &Job, choices: &mut [Progress<'_>], tx: &Tx, f: Failed) -> Result<(), CutShort> {
    if matches!(f.decision, Decision::Final) {
        return Err(f.into());
    }
    if shared.cfg.max_migrations == 0 {
        return Err(gave_up(job, 0, f.error).into());
    }
    tracing::warn!(error = %f.error, "the choices continue alone on other workers");
    let lead = (choices[0].avoid.clone(), choices[0].retries);
    let jobs: Vec<Job> = (0..choices.len() as u32)
        .map(|i| Job { request_id: job.request_id.clone(), prompt: job.prompt.clone(), params: job.params.choice(i), cache_salt: job.cache_salt.clone(), start: job.start })
        .collect();
    let each = choices.iter_mut().zip(&jobs).filter(|(p, _)| !p.done).map(|(p, j)| {
        (p.avoid, p.retries) = lead.clone();
        if !p.generated.is_empty() {
            p.migrations += 1;
            p.fault_at.get_or_insert(job.start.elapsed());
            metrics::counter!("ferry_router_migrations_total").increment(1);
        }
        // A group of one: it never splits.
        attempts(shared, j, std::slice::from_mut(p), tx)
    });
    futures_util::future::try_join_all(each).await.map(|_| ())
}

/// Acts on a failed attempt's decision: Ok when the request should try again (after waiting
/// for room, or counted as one more retry or migration), Err when it ends.
async fn recover(shared: &Arc<Shared>, job: &Job, prog: &mut Progress<'_>, tx: &Tx, f: Failed) -> Result<(), CutShort> {
    let cfg = &shared.cfg;
    match f.decision {
        Decision::Final => Err(f.into()),
        Decision::Wait => queue_wait(shared, prog, tx).await,
        Decision::Retry { .. } | Decision::Migrate { .. } => match prog.phase() {
            Phase::BeforeFirstToken => {
                if prog.retries >= cfg.max_retries {
                    return Err(gave_up(job, prog.retries, f.error).into());
                }
                prog.retries += 1;
                tracing::warn!(error = %f.error, attempt = prog.retries, choice = prog.choice, "retrying on other workers");
                metrics::counter!("ferry_router_retries_total").increment(1);
                Ok(())
            }
            // Tokens were streamed: the request continues elsewhere from them (and a
            // failure while re-prefilling a migrated request is one more migration).
            Phase::Streaming => {
                if prog.migrations >= cfg.max_migrations {
                    return Err(gave_up(job, prog.migrations, f.error).into());
                }
                prog.migrations += 1;
                prog.fault_at.get_or_insert(job.start.elapsed());
                tracing::warn!(error = %f.error, migration = prog.migrations, choice = prog.choice, streamed = prog.generated.len(), "migrating to other workers");
                metrics::counter!("ferry_router_migrations_total").increment(1);
                Ok(())
            }
        },
    }
}

fn gave_up(job: &Job, moves: u32, last: RouterError) -> Failed {
    Failed::fatal(RouterError::MovesExhausted { request_id: job.request_id.clone(), moves, last: Box::new(last) })
}

/// Joins the admission queue (or keeps this request's place) and waits for its turn.
async fn queue_wait(shared: &Arc<Shared>, prog: &mut Progress<'_>, tx: &Tx) -> Result<(), CutShort> {
    if prog.place.is_none() {
        prog.place = Some(shared.queue.enter().map_err(Failed::fatal)?);
    }
    let Some(place) = prog.place.as_mut() else {
        return Ok(());
    };
    tokio::select! {
        r = place.wait_turn() => r.map_err(|e| CutShort::Failed(Failed::fatal(e))),
        _ = tx.closed() => Err(CutShort::ClientGone),
    }
}

/// One attempt of the request's choices: admission, prefill (unless colocated), relay. The
/// choices of a group share an attempt only while none has streamed, so the first choice's
/// resumption point is the group's.
async fn attempt(shared: &Arc<Shared>, job: &Job, choices: &mut [Progress<'_>], tx: &Tx) -> Result<(), CutShort> {
    let (prompt, params) = choices[0].resume(job);
    if params.max_tokens == 0 {
        // Every token was streamed; only the worker's `final` was lost.
        for c in choices.iter_mut().filter(|c| !c.done) {
            relay::finish(job, c, tx, v1::FinishReason::Length, None).await?;
        }
        return Ok(());
    }
    let lead = &mut choices[0];
    let mut adm = admit::admit(shared, job, &prompt, &params, lead, tx).await?;
    // Admitted: the request's place in the queue goes to the next one.
    lead.place = None;
    lead.cached_tokens = adm.admitted.cached_tokens;
    // A colocated worker computes the prompt; so does a decode worker that holds all of it
    // but a short suffix (`admitted.local`): no prefill worker, no KV moves.
    let pre = match adm.colocated || adm.admitted.local {
        true => {
            lead.prefill_worker = adm.dw.id.clone();
            if adm.admitted.local {
                metrics::counter!("ferry_router_local_prefills_total").increment(1);
            }
            // No KV moved in this attempt.
            lead.kv = v1::KvTransferStats::default();
            None
        }
        false => Some(prefill::prefill(shared, job, &prompt, &params, &adm, lead, tx).await?),
    };
    let (pw, dw, kv, cached) = (lead.prefill_worker.clone(), lead.decode_worker.clone(), lead.kv, lead.cached_tokens);
    for c in choices.iter_mut().skip(1) {
        (c.prefill_worker, c.decode_worker, c.kv, c.cached_tokens) = (pw.clone(), dw.clone(), kv, cached);
    }
    relay::relay(shared, job, &params, choices, tx, &mut adm, pre).await
}

/// The decision for a failed call to `callee` (with `peer` the other worker of the request, for
/// a prefill), and its effects on the registry: a draining worker is marked so, a suspect one
/// that no longer accepts connections is marked dead, and the blamed one is avoided.
///
/// `phase` is the attempt's own: admission and prefill pass [`Phase::BeforeFirstToken`] (nothing
/// of this attempt reached the client; [`drive`] counts a migration by what the request had
/// streamed before), the relay passes the request's.
async fn failed(shared: &Shared, prog: &mut Progress<'_>, job: &Job, phase: Phase, role: WorkerRole, callee: &Worker, peer: Option<&Worker>, s: Status) -> Failed {
    let fault = s.metadata().get(failure::FAULT_KEY).and_then(|v| v.to_str().ok()).and_then(WorkerFault::parse);
    let decision = failure::classify(s.code() as i32, fault, phase);
    let reg = &shared.registry;
    if fault == Some(WorkerFault::Draining) {
        reg.mark_draining(&callee.id);
    }
    let (blame, suspect) = match decision {
        Decision::Retry { blame, suspect } | Decision::Migrate { blame, suspect } => (blame, suspect),
        Decision::Wait | Decision::Final => (Blame::Callee, false),
    };
    let (blamed, blamed_role) = match (blame, peer) {
        (Blame::Peer, Some(p)) => (p, WorkerRole::Decode),
        _ => (callee, role),
    };
    if suspect && !reachable(&blamed.grpc_addr).await {
        reg.mark_dead(&blamed.id, s.message());
    }
    if matches!(decision, Decision::Retry { .. } | Decision::Migrate { .. }) && !prog.avoid.contains(&blamed.id) {
        prog.avoid.push(blamed.id.clone());
    }
    let error = match decision {
        Decision::Final => RouterError::WorkerFailed {
            role,
            worker: callee.id.clone(),
            request_id: job.request_id.clone(),
            code: s.code(),
            message: s.message().into(),
        },
        _ => RouterError::WorkerUnavailable {
            role: blamed_role,
            worker: blamed.id.clone(),
            request_id: job.request_id.clone(),
            message: format!("{:?}: {}", s.code(), s.message()),
        },
    };
    Failed { error, decision }
}

/// Maps a watched call's interruption to the attempt's halt.
async fn interrupted(shared: &Shared, prog: &mut Progress<'_>, job: &Job, phase: Phase, role: WorkerRole, callee: &Worker, peer: Option<&Worker>, i: Interrupt) -> CutShort {
    match i {
        Interrupt::ClientGone => CutShort::ClientGone,
        Interrupt::Failed(s) => CutShort::Failed(failed(shared, prog, job, phase, role, callee, peer, s).await),
    }
}

/// `logprobs`: one per id of `token_ids` when they were asked for, else empty. `index`: the
/// choice.
async fn send_delta(tx: &Tx, rid: &str, index: u32, text: String, token_ids: Vec<u32>, logprobs: Vec<v1::TokenLogprob>) -> Result<(), CutShort> {
    let delta = v1::TokenDelta { text, token_ids, logprobs, index, ..Default::default() };
    let msg = v1::GenerateResponse { request_id: rid.into(), event: Some(Event::Delta(delta)) };
    tx.send(Ok(msg)).await.map_err(|_| CutShort::ClientGone)
}
