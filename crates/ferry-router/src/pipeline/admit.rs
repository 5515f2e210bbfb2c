//! Step 1: admission on the decode (or colocated) worker with the most room. A worker that
//! refuses (no room, draining) or is gone is skipped for the next one; when none has room the
//! request waits in the admission queue.

use std::sync::Arc;

use ferry_core::failure::{Decision, Phase};
use ferry_core::cache_policy::{PrefixWeights, rank_decode_with_prefix};
use ferry_core::routing::{blocks_needed, rank_decode};
use ferry_core::{SamplingParams, WorkerRole, WorkerState};
use ferry_proto::v1::{self, decode_response::Event as DecodeEvent};
use tonic::{Status, Streaming};

use crate::config::PrefixRouting;
use crate::pipeline::call::{Interrupt, watched};
use crate::pipeline::failure::failed;
use crate::pipeline::price::{chain_for, expected_prefill_seconds};
use crate::pipeline::request::{CutShort, Failed, Job, Progress, Tx};
use crate::RouterError;
use crate::workers::dial::MAX_MESSAGE_BYTES;
use crate::workers::load::{InflightGuard, PrefixChains};
use crate::workers::registry::Worker;
use crate::state::Shared;

/// A decode worker that admitted the request, and its stream.
pub struct Admission {
    pub dw: Worker,
    pub stream: Streaming<v1::DecodeResponse>,
    pub admitted: v1::Admitted,
    /// The worker is colocated: it prefills the prompt itself, no KV moves.
    pub colocated: bool,
    /// Presented by the prefill worker with the KV; only the router and it ever see it.
    pub transfer_token: String,
    /// The first KV block the decode worker lacks (it holds the prompt's cached prefix before).
    pub start_block: u32,
    /// The pool's KV block size (tokens).
    pub block_size: u32,
    /// The prompt's block chain (empty when routing by load alone), which the prefill step
    /// prices the prefill workers' cached prefixes by too.
    pub chain: PrefixChains,
    _guard: InflightGuard,
}

pub async fn admit(
    shared: &Arc<Shared>,
    job: &Job,
    prompt: &[u32],
    params: &SamplingParams,
    prog: &mut Progress<'_>,
    tx: &Tx,
) -> Result<Admission, CutShort> {
    let reg = &shared.registry;
    // Colocated workers, when there are any, serve the request alone (prefill included).
    let colocated = reg.ready().colocated > 0;
    let role = if colocated { WorkerRole::Colocated } else { WorkerRole::Decode };
    let (mut cands, block_size) = reg.decode_candidates(role);
    for c in cands.iter_mut().filter(|c| prog.avoid.contains(&c.id)) {
        c.state = WorkerState::Dead;
    }
    let ctx = reg.max_context().unwrap_or(u32::MAX) as usize;
    let need = if block_size == 0 { 0 } else { blocks_needed(prompt.len(), params.max_tokens, params.n, ctx, block_size) };
    let ready: Vec<_> = cands.iter().filter(|c| c.state == WorkerState::Ready).collect();
    if ready.is_empty() {
        return Err(Failed::fatal(RouterError::NoWorker { role }).into());
    }
    if ready.iter().all(|c| c.total_blocks > 0 && c.total_blocks < need) {
        // No worker could ever hold it: waiting would not help.
        let most = ready.iter().map(|c| c.total_blocks).max().unwrap_or(0);
        return Err(Failed::fatal(RouterError::InvalidRequest(format!(
            "the request needs {need} KV blocks (prompt {} + max_tokens {}, n {}) but the largest decode worker has {most}",
            prompt.len(),
            params.max_tokens,
            params.n
        )))
        .into());
    }
    // KV-aware: a worker holding the prompt's prefix goes first while it has room (its events
    // tell the router which blocks it holds); load alone otherwise.
    let chain = chain_for(shared, job, prompt, block_size as usize);
    let order = match shared.cfg.prefix_routing {
        PrefixRouting::KvAware => {
            // A decode worker loads its disk blocks on attach, so both tiers spare the transfer.
            let held: Vec<u32> = cands.iter().map(|c| reg.prefix_held(&c.id, &chain, usize::MAX).total() as u32).collect();
            rank_decode_with_prefix(&cands, &held, need, PrefixWeights::default())
        }
        PrefixRouting::LoadOnly => rank_decode(&cands, need),
    };
    let transfer_token = if colocated { String::new() } else { mint_transfer_token() };
    // Prompt logprobs need the whole prompt computed: never a local suffix.
    let local_prefill_max = match (colocated, params.prompt_logprobs) {
        (false, None) => shared.cfg.local_prefill_max.min(u32::MAX as usize) as u32,
        _ => 0,
    };
    // What a prefill worker would take, for the decode worker to weigh against its own queue.
    let remote_prefill_ms = match local_prefill_max {
        0 => 0.0,
        _ => expected_prefill_seconds(shared, &chain, prompt.len(), &prog.avoid, block_size as usize).map_or(0.0, |s| s * 1e3),
    };
    let (sampling, stop) = ferry_proto::sampling_to_wire(params);
    let (mut full, mut tried) = (order.is_empty(), 0);
    let mut last = None;
    for i in order {
        let Some(w) = reg.get(&cands[i].id) else {
            continue;
        };
        tried += 1;
        let req = v1::DecodeRequest {
            request_id: job.request_id.clone(),
            prompt_tokens: prompt.len() as u32,
            sampling: Some(sampling.clone()),
            stop: Some(stop.clone()),
            kv_timeout_ms: shared.cfg.kv_timeout.as_millis().min(u32::MAX as u128) as u32,
            prompt: if colocated { prompt.to_vec() } else { Vec::new() },
            transfer_token: transfer_token.clone(),
            // For the worker's prefix cache: it attaches what it holds and waits only for the rest.
            prompt_ids: if colocated { Vec::new() } else { prompt.to_vec() },
            cache_salt: job.cache_salt.clone().into(),
            local_prefill_max,
            remote_prefill_ms,
            ..Default::default()
        };
        let guard = InflightGuard::decode(reg, &w.id, need as u64);
        let r = watched(tx, &mut prog.waited, &[&w], shared.cfg.admit_timeout, "the decode admission", open_decode(&w, req)).await;
        let s = match r {
            Ok((stream, admitted)) => {
                prog.decode_worker = w.id.clone();
                let start_block = match admitted.cached_tokens {
                    0 => 0,
                    n if block_size > 0 && n % block_size == 0 => n / block_size,
                    n => {
                        // Not the reported block size: the worker broke the protocol.
                        let s = Status::internal(format!("admitted with {n} cached tokens, not whole blocks of {block_size}"));
                        let f = failed(shared, prog, job, Phase::BeforeFirstToken, role, &w, None, s).await;
                        return Err(f.into());
                    }
                };
                return Ok(Admission { dw: w, stream, admitted, colocated, transfer_token, start_block, block_size, chain, _guard: guard });
            }
            Err(Interrupt::ClientGone) => return Err(CutShort::ClientGone),
            Err(Interrupt::Failed(s)) => s,
        };
        let f = failed(shared, prog, job, Phase::BeforeFirstToken, role, &w, None, s).await;
        match f.decision {
            Decision::Final => return Err(f.into()),
            Decision::Wait => full = true,
            Decision::Retry { .. } | Decision::Migrate { .. } => {}
        }
        last = Some(f.error);
    }
    let error = RouterError::DecodeExhausted { need_blocks: need, tried };
    Err(match (full, last) {
        (true, _) => Failed { error, decision: Decision::Wait },
        // Every candidate was gone or leaving: the attempt fails and the next one avoids them.
        (false, last) => Failed {
            error: last.unwrap_or(error),
            decision: Decision::Retry { blame: ferry_core::failure::Blame::Callee, suspect: false },
        },
    }
    .into())
}

async fn open_decode(w: &Worker, req: v1::DecodeRequest) -> Result<(Streaming<v1::DecodeResponse>, v1::Admitted), Status> {
    let mut client = v1::decode_client::DecodeClient::new(w.channel.clone())
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    // The decode worker's spans are children of this call's (the router's `admission`).
    let mut stream = client.decode(ferry_proto::trace::request(&tracing::Span::current(), req)).await?.into_inner();
    match stream.message().await? {
        Some(v1::DecodeResponse { event: Some(DecodeEvent::Admitted(a)) }) => Ok((stream, a)),
        other => Err(Status::internal(format!("expected `admitted` first, got {other:?}"))),
    }
}

/// 128 random bits as 32 hex characters, from the thread-local CSPRNG (ChaCha, seeded by the OS).
fn mint_transfer_token() -> String {
    format!("{:032x}", rand::random::<u128>())
}
