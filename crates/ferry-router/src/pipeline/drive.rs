//! A request's attempts: run to its end, retried, migrated or waiting for room as each failure's
//! decision says (see [`crate::pipeline`]).

use std::sync::Arc;
use std::time::Duration;

use ferry_core::failure::{Decision, Phase};
use ferry_proto::v1;
use tonic::Status;
use tracing::Instrument;

use crate::RouterError;
use crate::pipeline::request::{CutShort, Failed, Job, Progress, Tx};
use crate::pipeline::{admit, prefill, relay};
use crate::state::Shared;

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
    let now = job.start.elapsed();
    // A single-choice request's figures, for the autoscaler's window.
    let single = match choices.as_slice() {
        [one] => Some(one),
        _ => None,
    };
    let finished = |ok: bool| {
        let ((ttft, tpot), output) = single.map_or(((now, 0.0), 0), |c| (c.latency(now), c.generated.len()));
        crate::ops::window::Finished { prompt: job.prompt.len(), output, ttft_ms: ttft.as_secs_f64() * 1e3, tpot_ms: tpot * 1e3, ok }
    };
    match result {
        Ok(()) => {
            crate::metrics::request_outcome("ok");
            // Goodput: every choice within both targets.
            crate::metrics::observe_goodput(choices.iter().map(|c| c.latency(now)));
            if single.is_some() {
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
        queue_wait(shared, &mut choices[0], tx).instrument(tracing::info_span!("queue")).await?;
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
            let _mark = tracing::info_span!("migration", migration = p.migrations + 1, streamed = p.generated.len(), choice = p.choice).entered();
            p.migrations += 1;
            p.fault_at.get_or_insert(job.start.elapsed());
            metrics::counter!(crate::metrics::names::MIGRATIONS).increment(1);
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
        Decision::Wait => queue_wait(shared, prog, tx).instrument(tracing::info_span!("queue")).await,
        Decision::Retry { .. } | Decision::Migrate { .. } => match prog.phase() {
            Phase::BeforeFirstToken => {
                if prog.retries >= cfg.max_retries {
                    return Err(gave_up(job, prog.retries, f.error).into());
                }
                prog.retries += 1;
                tracing::warn!(error = %f.error, attempt = prog.retries, choice = prog.choice, "retrying on other workers");
                metrics::counter!(crate::metrics::names::RETRIES).increment(1);
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
                // A mark in the trace: the next attempt's spans (admission, prefill, decode) follow it.
                let _mark = tracing::info_span!("migration", migration = prog.migrations, streamed = prog.generated.len(), error = %f.error).entered();
                tracing::warn!(error = %f.error, migration = prog.migrations, choice = prog.choice, streamed = prog.generated.len(), "migrating to other workers");
                metrics::counter!(crate::metrics::names::MIGRATIONS).increment(1);
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
    let mut adm = admit::admit(shared, job, &prompt, &params, lead, tx).instrument(tracing::info_span!("admission")).await?;
    // Admitted: the request's place in the queue goes to the next one; its time there is its
    // queue time (once per request, at its first admission).
    if !lead.queue_time_recorded {
        lead.queue_time_recorded = true;
        crate::metrics::observe_queue_time(lead.place.as_ref().map_or(Duration::ZERO, |p| p.waited()));
    }
    lead.place = None;
    lead.cached_tokens = adm.admitted.cached_tokens;
    // A colocated worker computes the prompt; so does a decode worker that holds all of it
    // but a short suffix (`admitted.local`): no prefill worker, no KV moves.
    let pre = match adm.colocated || adm.admitted.local {
        true => {
            lead.prefill_worker = adm.dw.id.clone();
            if adm.admitted.local {
                metrics::counter!(crate::metrics::names::LOCAL_PREFILLS).increment(1);
            }
            // No KV moved in this attempt.
            lead.kv = v1::KvTransferStats::default();
            None
        }
        false => Some(prefill::prefill(shared, job, &prompt, &params, &adm, lead, tx).instrument(tracing::info_span!("prefill", prompt_tokens = prompt.len())).await?),
    };
    let (pw, dw, kv, cached) = (lead.prefill_worker.clone(), lead.decode_worker.clone(), lead.kv, lead.cached_tokens);
    for c in choices.iter_mut().skip(1) {
        (c.prefill_worker, c.decode_worker, c.kv, c.cached_tokens) = (pw.clone(), dw.clone(), kv, cached);
    }
    relay::relay(shared, job, &params, choices, tx, &mut adm, pre).instrument(tracing::info_span!("decode", worker = %dw)).await
}
