//! Step 3: the first tokens from prefill, then the decode stream, relayed to the client. Text is
//! detokenized and stop strings applied here by the same [`ferry_tokenizer::TextStream`] the
//! engine's `generate_seq` uses locally; it lives in the request's [`Progress`], so it runs on
//! unbroken across a migration.

use std::sync::Arc;

use ferry_core::failure::Phase;
use ferry_core::{SamplingParams, WorkerRole};
use ferry_proto::v1::{self, decode_response::Event as DecodeEvent, generate_response::Event};

use tonic::Status;

use crate::pipeline::admit::Admission;
use crate::pipeline::call::watched;
use crate::pipeline::failure::interrupted;
use crate::pipeline::request::{CutShort, Failed, Job, Progress, Tx};
use crate::RouterError;
use crate::state::Shared;

pub fn protocol(job: &Job, worker: &str, message: String) -> CutShort {
    CutShort::Failed(Failed::fatal(RouterError::Protocol {
        worker: worker.into(),
        request_id: job.request_id.clone(),
        message,
    }))
}

/// Pushes `ids` through the relay and sends what they release with them, and their `logprobs`
/// (one per id, or none); whether a stop string ended the request (the ids after it are not
/// sent).
pub async fn forward(job: &Job, worker: &str, prog: &mut Progress<'_>, tx: &Tx, ids: &[u32], logprobs: &[v1::TokenLogprob]) -> Result<bool, CutShort> {
    if !logprobs.is_empty() && logprobs.len() != ids.len() {
        return Err(protocol(job, worker, format!("{} logprobs for {} tokens", logprobs.len(), ids.len())));
    }
    let mut out = String::new();
    let mut taken = 0;
    let mut stopped = false;
    for &id in ids {
        taken += 1;
        let (delta, stop) = prog.text.push(id).map_err(|m| protocol(job, worker, m.to_string()))?;
        out.push_str(&delta);
        if stop {
            stopped = true;
            break;
        }
    }
    prog.sent(job, &ids[..taken]);
    let logprobs = logprobs.get(..taken).unwrap_or_default().to_vec();
    send_delta(tx, &job.request_id, prog.choice, out, ids[..taken].to_vec(), logprobs).await?;
    Ok(stopped)
}

/// Sends the prompt's logprobs on a delta of their own (once per request and choice: later
/// attempts do not ask for them).
pub async fn send_prompt_logprobs(job: &Job, prog: &mut Progress<'_>, tx: &Tx, prompt_logprobs: Vec<v1::TokenLogprob>) -> Result<(), CutShort> {
    if prog.prompt_logprobs_sent {
        return Ok(());
    }
    prog.prompt_logprobs_sent = true;
    let delta = v1::TokenDelta { prompt_logprobs, index: prog.choice, ..Default::default() };
    let msg = v1::GenerateResponse { request_id: job.request_id.clone(), event: Some(Event::Delta(delta)) };
    tx.send(Ok(msg)).await.map_err(|_| CutShort::ClientGone)
}

/// The first tokens from prefill (one per choice), then the decode stream, each message to its
/// choice. A choice that a stop string ends here is finished for the client; the worker's
/// further tokens for it are dropped (the stream cannot cancel one choice alone), and once every
/// choice is finished, dropping the stream cancels what is left on the worker.
pub async fn relay(
    shared: &Arc<Shared>,
    job: &Job,
    params: &SamplingParams,
    choices: &mut [Progress<'_>],
    tx: &Tx,
    adm: &mut Admission,
    pre: Option<v1::PrefillResponse>,
) -> Result<(), CutShort> {
    let dw = adm.dw.clone();
    let n = choices.len();
    // Colocated (no `pre`): the first tokens come on the decode stream.
    if let Some(p) = pre {
        if p.more_choices.len() + 1 != n {
            return Err(protocol(job, &choices[0].prefill_worker, format!("prefill answered {} first tokens for {n} choices", p.more_choices.len() + 1)));
        }
        let firsts = std::iter::once((p.first_token, p.first_is_stop, p.first_logprob)).chain(p.more_choices.into_iter().map(|f| (f.token, f.is_stop, f.logprob)));
        for (prog, (token, is_stop, logprob)) in choices.iter_mut().zip(firsts) {
            if params.prompt_logprobs.is_some() {
                send_prompt_logprobs(job, prog, tx, p.prompt_logprobs.clone()).await?;
            }
            if is_stop {
                finish(job, prog, tx, v1::FinishReason::StopToken, Some(params.token_offset)).await?;
            } else if forward(job, &dw.id, prog, tx, &[token], &logprob.into_iter().collect::<Vec<_>>()).await? {
                finish(job, prog, tx, v1::FinishReason::StopString, None).await?;
            }
        }
    }
    let mut ended = vec![false; n];
    while !choices.iter().all(|p| p.done) {
        let phase = if choices.iter().any(|p| !p.generated.is_empty()) { Phase::Streaming } else { Phase::BeforeFirstToken };
        let m = watched(tx, &mut choices[0].waited, &[&dw], shared.cfg.token_timeout, "the decode stream", async {
            // The stream closed without every `final`: the worker went away mid-request.
            adm.stream.message().await?.ok_or_else(|| Status::unavailable("the decode stream ended without `final`"))
        })
        .await;
        let m = match m {
            Ok(m) => m,
            Err(i) => return Err(interrupted(shared, &mut choices[0], job, phase, WorkerRole::Decode, &dw, None, i).await),
        };
        let ours = |c: u32| (c as usize) < n;
        match m.event {
            Some(DecodeEvent::PromptLogprobs(lp)) => {
                for prog in choices.iter_mut() {
                    send_prompt_logprobs(job, prog, tx, lp.logprobs.clone()).await?;
                }
            }
            Some(DecodeEvent::Tokens(t)) if ours(t.choice) => {
                let prog = &mut choices[t.choice as usize];
                if !prog.done && forward(job, &dw.id, prog, tx, &t.ids, &t.logprobs).await? {
                    finish(job, prog, tx, v1::FinishReason::StopString, None).await?;
                }
            }
            Some(DecodeEvent::Final(f)) if ours(f.choice) => {
                let c = f.choice as usize;
                if ended[c] {
                    return Err(protocol(job, &dw.id, format!("a second `final` for choice {c}")));
                }
                ended[c] = true;
                let prog = &mut choices[c];
                prog.spec.0 += f.spec_proposed_tokens;
                prog.spec.1 += f.spec_accepted_tokens;
                if !prog.done {
                    let reason = v1::FinishReason::try_from(f.finish_reason).unwrap_or(v1::FinishReason::Unspecified);
                    finish(job, prog, tx, reason, Some(params.token_offset + f.completion_tokens)).await?;
                }
            }
            other => return Err(protocol(job, &dw.id, format!("unexpected message {other:?} for a request of {n} choices"))),
        }
    }
    Ok(())
}

/// Ends the request: what the relay held back (unless a stop string ended it), then the final
/// summary. `completion`: the tokens generated as the worker counted them (else those streamed).
pub async fn finish(
    job: &Job,
    prog: &mut Progress<'_>,
    tx: &Tx,
    finish: v1::FinishReason,
    completion: Option<u32>,
) -> Result<(), CutShort> {
    if finish != v1::FinishReason::StopString {
        let rest = prog.text.flush().map_err(|m| protocol(job, &prog.decode_worker, m.to_string()))?;
        if !rest.is_empty() {
            send_delta(tx, &job.request_id, prog.choice, rest, vec![], vec![]).await?;
        }
    }
    let n = prog.generated.len() as u32;
    let e2e = job.start.elapsed();
    let (ttft, tpot) = prog.latency(e2e);
    let overhead = e2e.saturating_sub(prog.waited);
    crate::metrics::observe_finished(&crate::metrics::Finished { ttft, tpot_s: tpot, e2e, overhead, generated: n as usize, kv: &prog.kv });
    // The prompt is counted once per request (choice 0), however many choices share it.
    if prog.choice == 0 {
        crate::metrics::observe_prompt(job.prompt.len(), u64::from(prog.cached_tokens));
    }
    let fin = v1::GenerateFinal {
        finish_reason: finish as i32,
        prompt_tokens: job.prompt.len() as u32,
        completion_tokens: completion.unwrap_or(n),
        ttft_ms: ttft.as_secs_f64() * 1e3,
        tpot_ms: tpot * 1e3,
        e2e_ms: e2e.as_secs_f64() * 1e3,
        prefill_worker: prog.prefill_worker.clone(),
        decode_worker: prog.decode_worker.clone(),
        kv: Some(prog.kv),
        migrations: prog.migrations,
        retries: prog.retries,
        cached_tokens: prog.cached_tokens,
        index: prog.choice,
        // Counted where calls are scanned out of the text (the gRPC API's tool relay).
        tool_calls: 0,
        spec_proposed_tokens: prog.spec.0,
        spec_accepted_tokens: prog.spec.1,
    };
    prog.done = true;
    let msg = v1::GenerateResponse { request_id: job.request_id.clone(), event: Some(Event::Final(fin)) };
    tx.send(Ok(msg)).await.map_err(|_| CutShort::ClientGone)
}

/// `logprobs`: one per id of `token_ids` when they were asked for, else empty. `index`: the
/// choice.
async fn send_delta(tx: &Tx, rid: &str, index: u32, text: String, token_ids: Vec<u32>, logprobs: Vec<v1::TokenLogprob>) -> Result<(), CutShort> {
    let delta = v1::TokenDelta { text, token_ids, logprobs, index, ..Default::default() };
    let msg = v1::GenerateResponse { request_id: rid.into(), event: Some(Event::Delta(delta)) };
    tx.send(Ok(msg)).await.map_err(|_| CutShort::ClientGone)
}
