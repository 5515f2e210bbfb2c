//! A request with `n` > 1 choices (OpenAI's `n`): one admission that reserves KV for every
//! choice, one prefill that samples each choice's first token and ships the prompt's KV once, and
//! one decode stream on which the decode worker runs the choices as sequences sharing the
//! prompt's KV blocks. Each choice has its own [`Progress`] (detokenizer, stop strings, tokens
//! so far); every delta and final names its choice.
//!
//! Before any token reached the client, a failure retries the whole group (as [`super::drive`]
//! retries one request). After, the group is over: each unfinished choice continues alone, as a
//! one-choice request with its own seed (`SamplingParams::choice`), from the tokens it streamed,
//! exactly as a migrated request does; the choices run concurrently.

use std::sync::Arc;

use ferry_core::WorkerRole;
use ferry_core::failure::Decision;
use ferry_proto::v1::{self, decode_response::Event as DecodeEvent};
use futures_util::future::try_join_all;
use tonic::Status;

use super::admit::Admission;
use super::call::watched;
use super::relay::{finish, forward, protocol, send_prompt_logprobs};
use super::{CutShort, Job, Progress, Tx, attempts, gave_up, interrupted, prefill, queue_wait, recover};
use crate::service::Shared;

pub(super) async fn drive(shared: &Arc<Shared>, job: &Job, tx: &Tx) -> Result<(), CutShort> {
    let n = job.params.n;
    let mut progs: Vec<Progress> = (0..n).map(|i| Progress::new(shared, &job.params, i)).collect();
    // Requests already waiting for room are not overtaken (the first choice holds the place).
    if shared.queue.depth() > 0 {
        queue_wait(shared, &mut progs[0], tx).await?;
    }
    let f = loop {
        let f = match attempt(shared, job, &mut progs, tx).await {
            Ok(()) => return Ok(()),
            Err(CutShort::ClientGone) => return Err(CutShort::ClientGone),
            Err(CutShort::Failed(f)) => f,
        };
        // Something reached the client (a token, or a choice's end): no starting over.
        if progs.iter().any(|p| p.done || !p.generated.is_empty()) {
            break f;
        }
        // Nothing streamed yet: the group starts again (the first choice keeps the count).
        recover(shared, job, &mut progs[0], tx, f).await?;
    };
    if matches!(f.decision, Decision::Final) {
        return Err(f.into());
    }
    if shared.cfg.max_migrations == 0 {
        return Err(gave_up(job, 0, f.error).into());
    }
    tracing::warn!(error = %f.error, "the choices continue alone on other workers");
    let lead = (progs[0].avoid.clone(), progs[0].retries);
    let jobs: Vec<Job> = (0..n)
        .map(|i| Job { request_id: job.request_id.clone(), prompt: job.prompt.clone(), params: job.params.choice(i), cache_salt: job.cache_salt.clone(), start: job.start })
        .collect();
    let alone = progs.iter_mut().zip(&jobs).filter(|(p, _)| !p.done).map(|(p, j)| {
        (p.avoid, p.retries) = lead.clone();
        if !p.generated.is_empty() {
            p.migrations += 1;
            p.fault_at.get_or_insert(job.start.elapsed());
            metrics::counter!("ferry_router_migrations_total").increment(1);
        }
        attempts(shared, j, p, tx)
    });
    try_join_all(alone).await.map(|_| ())
}

/// One attempt of the whole group: admission, prefill (unless colocated), the shared stream.
async fn attempt(shared: &Arc<Shared>, job: &Job, progs: &mut [Progress<'_>], tx: &Tx) -> Result<(), CutShort> {
    let mut params = job.params.clone();
    if progs[0].prompt_logprobs_sent {
        params.prompt_logprobs = None;
    }
    let lead = &mut progs[0];
    let mut adm = super::admit::admit(shared, job, &job.prompt, &params, lead, tx).await?;
    lead.place = None;
    lead.cached_tokens = adm.admitted.cached_tokens;
    let pre = match adm.colocated || adm.admitted.local {
        true => {
            lead.prefill_worker = adm.dw.id.clone();
            lead.kv = v1::KvTransferStats::default();
            None
        }
        false => Some(prefill::prefill(shared, job, &job.prompt, &params, &adm, lead, tx).await?),
    };
    let (pw, dw, kv, cached) = (lead.prefill_worker.clone(), lead.decode_worker.clone(), lead.kv, lead.cached_tokens);
    for p in progs.iter_mut() {
        (p.prefill_worker, p.decode_worker, p.kv, p.cached_tokens) = (pw.clone(), dw.clone(), kv, cached);
    }
    relay(shared, job, &params, progs, tx, &mut adm, pre).await
}

/// The first tokens from prefill, then the decode stream, each message to its choice's relay.
/// A choice that a stop string ends here is finished for the client; the worker's further
/// tokens for it are dropped (the stream cannot cancel one choice alone).
async fn relay(
    shared: &Arc<Shared>,
    job: &Job,
    params: &ferry_core::SamplingParams,
    progs: &mut [Progress<'_>],
    tx: &Tx,
    adm: &mut Admission,
    pre: Option<v1::PrefillResponse>,
) -> Result<(), CutShort> {
    let dw = adm.dw.clone();
    let n = progs.len();
    if let Some(p) = pre {
        if p.more_choices.len() + 1 != n {
            return Err(protocol(job, &progs[0].prefill_worker, format!("prefill answered {} first tokens for {n} choices", p.more_choices.len() + 1)));
        }
        let firsts = std::iter::once((p.first_token, p.first_is_stop, p.first_logprob)).chain(p.more_choices.into_iter().map(|f| (f.token, f.is_stop, f.logprob)));
        for (prog, (token, is_stop, logprob)) in progs.iter_mut().zip(firsts) {
            if params.prompt_logprobs.is_some() {
                send_prompt_logprobs(job, prog, tx, p.prompt_logprobs.clone()).await?;
            }
            if is_stop {
                finish(job, prog, tx, v1::FinishReason::StopToken, Some(0)).await?;
            } else if forward(job, &dw.id, prog, tx, &[token], &logprob.into_iter().collect::<Vec<_>>()).await? {
                finish(job, prog, tx, v1::FinishReason::StopString, None).await?;
            }
        }
    }
    let mut ended = vec![false; n];
    while ended.iter().any(|e| !e) {
        let phase = if progs.iter().any(|p| !p.generated.is_empty()) { ferry_core::failure::Phase::Streaming } else { ferry_core::failure::Phase::BeforeFirstToken };
        let m = watched(tx, &mut progs[0].waited, &[&dw], shared.cfg.token_timeout, "the decode stream", async {
            adm.stream.message().await?.ok_or_else(|| Status::unavailable("the decode stream ended before every choice's `final`"))
        })
        .await;
        let m = match m {
            Ok(m) => m,
            Err(i) => return Err(interrupted(shared, &mut progs[0], job, phase, WorkerRole::Decode, &dw, None, i).await),
        };
        let choice = |c: u32| (c as usize) < n;
        match m.event {
            Some(DecodeEvent::PromptLogprobs(lp)) => {
                for prog in progs.iter_mut() {
                    send_prompt_logprobs(job, prog, tx, lp.logprobs.clone()).await?;
                }
            }
            Some(DecodeEvent::Tokens(t)) if choice(t.choice) => {
                let prog = &mut progs[t.choice as usize];
                if !prog.done && forward(job, &dw.id, prog, tx, &t.ids, &t.logprobs).await? {
                    finish(job, prog, tx, v1::FinishReason::StopString, None).await?;
                }
            }
            Some(DecodeEvent::Final(f)) if choice(f.choice) => {
                let c = f.choice as usize;
                if ended[c] {
                    return Err(protocol(job, &dw.id, format!("a second `final` for choice {c}")));
                }
                ended[c] = true;
                let prog = &mut progs[c];
                if !prog.done {
                    let reason = v1::FinishReason::try_from(f.finish_reason).unwrap_or(v1::FinishReason::Unspecified);
                    finish(job, prog, tx, reason, Some(f.completion_tokens)).await?;
                }
            }
            other => return Err(protocol(job, &dw.id, format!("unexpected message {other:?} for a request of {n} choices"))),
        }
        // Every choice is finished for the client (stop strings may end them before the worker
        // does): dropping the stream cancels what is left on the worker.
        if progs.iter().all(|p| p.done) {
            break;
        }
    }
    Ok(())
}
