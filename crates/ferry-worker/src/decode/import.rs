//! A decode worker's request arrives as KV from a prefill worker: import it (onto the prompt's
//! cached prefix when this worker held one), answer the transfer, and resume each choice's
//! chooser from the first token the prefill worker sampled.

use super::admission::{DecodeEvent, FirstToken, HeldPrefix};
use super::fork::Start;
use crate::error::WorkerError;
use crate::pick::{resume_pickers, Rules};
use ferry_core::SamplingParams;
use ferry_engine::{Engine, EngineError, KvBuffer, Sequence};
use tokio::sync::{mpsc, oneshot};

/// A request's KV as it arrived (a [`super::admission::Source::Kv`]).
pub(super) struct Arrived {
    pub payload: Vec<u8>,
    pub device: Option<KvBuffer>,
    pub firsts: Vec<FirstToken>,
    pub onto: Option<HeldPrefix>,
    pub tokens: Option<Vec<u32>>,
    pub imported: oneshot::Sender<(Result<(), WorkerError>, Vec<u8>)>,
}

/// The request the KV is for.
pub(super) struct Request<'a> {
    pub request_id: &'a str,
    pub params: &'a SamplingParams,
    pub rules: &'a Rules,
    pub events: &'a mpsc::UnboundedSender<DecodeEvent>,
}

/// Import `kv` for request `a`. Ok(Some): the request joins the batch; Ok(None): it ended
/// here (its failure told to the transfer or the request). Err only when the import failed at
/// the backend (the engine is broken; the request has its failure already).
pub(super) fn import(engine: &mut Engine, a: &Request, kv: Arrived) -> Result<Option<(Sequence, Vec<Start>)>, EngineError> {
    let Arrived { payload, device, firsts, onto, tokens, imported } = kv;
    let onto = onto.and_then(HeldPrefix::take);
    let tokens = tokens.as_deref();
    // A failed import drops `onto` with its error: the held prefix's blocks go back.
    let seq = match (onto, &device) {
        (Some(seq), Some(body)) => engine.import_kv_buffer_onto(seq.id(), &payload, body, tokens).map(|()| seq),
        (Some(seq), None) => engine.import_kv_onto(seq.id(), &payload, tokens).map(|()| seq),
        (None, Some(body)) => engine.import_kv_buffer(&payload, body).map(|id| engine.own(id)),
        (None, None) => engine.import_kv(&payload).map(|id| engine.own(id)),
    };
    drop(device);
    let seq = match seq {
        Ok(seq) => seq,
        Err(e) if e.is_device_fault() => {
            let what = format!("importing the KV of request {}: {e}", a.request_id);
            let _ = imported.send((Err(WorkerError::EngineFailed(what)), payload));
            return Err(e);
        }
        Err(e) => {
            let _ = imported.send((Err(WorkerError::from(e)), payload));
            return Ok(None);
        }
    };
    // The request went away meanwhile: `seq` drops, freeing its blocks.
    if imported.send((Ok(()), payload)).is_err() {
        return Ok(None);
    }
    // The first tokens were sampled under the grammar on the prefill worker: each choice's
    // matcher here takes its own before sampling the next.
    let n = a.params.n.max(1) as usize;
    if firsts.len() != n {
        let what = format!("the KV's end carries first tokens for {} choices; the request has {n}", firsts.len());
        let _ = a.events.send(DecodeEvent::Failed(WorkerError::SequenceFailed { request_id: a.request_id.to_string(), what }));
        return Ok(None);
    }
    let states: Vec<(u32, bool, u64)> = firsts.iter().map(|f| (f.token, f.is_stop, f.sampler_state)).collect();
    let pickers = match resume_pickers(&a.params, &a.rules, &states) {
        Ok(p) => p,
        Err((choice, token, e)) => {
            let what = format!("on the first token {token} of choice {choice}: {e}");
            let _ = a.events.send(DecodeEvent::Failed(WorkerError::GrammarFailed { request_id: a.request_id.to_string(), what }));
            return Ok(None);
        }
    };
    let choices = firsts.iter().zip(pickers).map(|(f, picker)| Start { token: f.token, is_stop: f.is_stop, picker }).collect();
    Ok(Some((seq, choices)))
}
