//! Step 2: prefill on the least loaded prefill worker, pushing the KV to the admitted decode
//! worker. A draining or full prefill worker is skipped for the next one (each at most once per
//! attempt); the call ends early if either worker is marked dead.

use std::sync::Arc;

use ferry_core::SamplingParams;
use ferry_core::WorkerRole;
use ferry_core::WorkerState;
use ferry_core::failure::{Decision, Phase};
use ferry_core::routing::pick_prefill_for;
use ferry_proto::v1;

use crate::pipeline::admit::Admission;
use crate::pipeline::price::{Priced, priced, work_at};
use crate::pipeline::call::{Interrupt, watched};
use crate::pipeline::failure::failed;
use crate::pipeline::request::{CutShort, Failed, Job, Progress, Tx};
use crate::RouterError;
use crate::workers::dial::MAX_MESSAGE_BYTES;
use crate::workers::load::InflightGuard;
use crate::state::Shared;

pub async fn prefill(
    shared: &Arc<Shared>,
    job: &Job,
    prompt: &[u32],
    params: &SamplingParams,
    adm: &Admission,
    prog: &mut Progress<'_>,
    tx: &Tx,
) -> Result<v1::PrefillResponse, CutShort> {
    let reg = &shared.registry;
    let dw = &adm.dw;
    let (sampling, stop) = ferry_proto::sampling_to_wire(params);
    // Workers that were full for this attempt: skipped now, tried again after a wait.
    let mut full: Vec<String> = Vec::new();
    let bs = adm.block_size as usize;
    loop {
        let Priced { cands, held } = priced(shared, &adm.chain, prompt.len(), bs, |id| prog.avoid.iter().chain(&full).any(|a| a == id));
        let work = |i: usize| work_at(prompt.len(), held[i], bs);
        let picked = pick_prefill_for(&cands, &work).and_then(|i| reg.get(&cands[i].id).map(|w| (w, held[i])));
        let Some((pw, pw_held)) = picked else {
            let error = RouterError::NoWorker { role: WorkerRole::Prefill };
            return Err(match full.is_empty() {
                true => Failed::fatal(error),
                false => Failed { error, decision: Decision::Wait },
            }
            .into());
        };
        crate::metrics::prefix_routed(pw_held.main_tier());
        if tracing::enabled!(tracing::Level::DEBUG) {
            let priced: Vec<String> = cands
                .iter()
                .enumerate()
                .filter(|(_, c)| c.state == WorkerState::Ready)
                .map(|(i, c)| format!("{}: {} cached, {:.0} tok/s, {:.3} s", c.id, held[i].total() * bs, c.tokens_per_s, c.expected_seconds_for(work(i)).unwrap_or(f64::NAN)))
                .collect();
            tracing::debug!(request_id = %job.request_id, worker = %pw.id, "prefill pick: {}", priced.join("; "));
        }
        let chosen = crate::workers::transport::choose(shared.cfg.kv_transport, &pw.kv_transports, &dw.kv_transports);
        let req = v1::PrefillRequest {
            request_id: job.request_id.clone(),
            prompt: prompt.to_vec(),
            sampling: Some(sampling.clone()),
            stop: Some(stop.clone()),
            target: Some(v1::KvTarget {
                decode_worker: dw.id.clone(),
                grpc_addr: dw.grpc_addr.clone(),
                data_addr: adm.admitted.data_addr.clone(),
                transfer_id: adm.admitted.transfer_id,
                transfer_token: adm.transfer_token.clone(),
                transport: chosen as i32,
                // The decode worker holds the blocks before this one (its cached prefix).
                start_block: adm.start_block,
            }),
            cache_salt: job.cache_salt.clone().into(),
        };
        let mut client = v1::prefill_client::PrefillClient::new(pw.channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        let guard = InflightGuard::new(reg, &pw.id, prompt.len() as u64);
        let timeout = shared.cfg.prefill_timeout;
        // The prefill worker's spans are children of this call's (the router's `prefill`).
        let mut call = ferry_proto::trace::request(&tracing::Span::current(), req);
        call.set_timeout(timeout);
        let r = watched(tx, &mut prog.waited, &[&pw, dw], timeout, "the prefill", async {
            client.prefill(call).await.map(tonic::Response::into_inner)
        })
        .await;
        drop(guard);
        let s = match r {
            Ok(pre) => {
                crate::metrics::observe_kv_transport(chosen, pre.kv.as_ref());
                prog.prefill_worker = pw.id.clone();
                prog.kv = pre.kv.unwrap_or_default();
                // Tokens the prefill worker did not compute (its own cache served them).
                prog.cached_tokens = pre.cached_tokens;
                return Ok(pre);
            }
            Err(Interrupt::ClientGone) => return Err(CutShort::ClientGone),
            Err(Interrupt::Failed(s)) => s,
        };
        let f = failed(shared, prog, job, Phase::BeforeFirstToken, WorkerRole::Prefill, &pw, Some(dw), s).await;
        match f.decision {
            Decision::Wait => full.push(pw.id.clone()),
            // A draining prefill worker: the next one is tried with the same admission.
            Decision::Retry { blame: ferry_core::failure::Blame::Callee, suspect: false } => {}
            // Anything else fails the attempt: its decode admission is dropped (freeing the
            // reservation) and the next attempt avoids the blamed worker.
            _ => return Err(f.into()),
        }
    }
}
