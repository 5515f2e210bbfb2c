//! One step, failing only the sequences that fail. [`Engine::step`] is all-or-nothing: when any
//! item is wrong (a token outside the vocabulary, a sequence the engine does not know, no block
//! left for it) nothing advances. A batch must not fail for one of its sequences, so a failed
//! batched step is re-run item by item: the items that succeed alone keep their logits, the ones
//! that fail alone are the culprits. Only a failure of the backend itself
//! ([`EngineError::is_device_fault`]) fails the whole step: then the engine is broken.

use crate::error::WorkerError;
use ferry_engine::{DeviceBackend, Engine, EngineError, KvView, StepItem};

/// A step's layer callback: (`None` for the whole batch or `Some(item)` alone, layer, the KV).
pub type OnLayer<'a> = dyn FnMut(Option<usize>, usize, &KvView<DeviceBackend>) + Send + 'a;

/// One item's result: its logits, or why it failed alone.
pub type Outcome = std::result::Result<Vec<f32>, EngineError>;

/// Run `items` as one step; if that fails for a reason other than the device, run each alone.
/// `on_layer(which, layer, kv)` is the step's layer callback, `which` being `None` for the whole
/// batch and `Some(k)` when item `k` runs alone. Err: a device fault.
pub fn step_isolating(
    engine: &mut Engine,
    items: &[StepItem],
    on_layer: &mut OnLayer<'_>,
) -> std::result::Result<Vec<Outcome>, EngineError> {
    match engine.step(items, &mut |l, kv| on_layer(None, l, kv)) {
        Ok(logits) => Ok(logits.into_iter().map(Ok).collect()),
        Err(e) if e.is_device_fault() => Err(e),
        Err(e) if items.len() == 1 => Ok(vec![Err(e)]),
        Err(e) => {
            tracing::warn!(items = items.len(), "a batched step failed ({e}): running its sequences one by one to find the culprit");
            metrics::counter!(crate::cluster::metrics::names::STEP_ISOLATIONS).increment(1);
            let mut out = Vec::with_capacity(items.len());
            for (k, it) in items.iter().enumerate() {
                match engine.step(std::slice::from_ref(it), &mut |l, kv| on_layer(Some(k), l, kv)) {
                    Ok(mut l) => out.push(Ok(l.pop().unwrap_or_default())),
                    Err(e) if e.is_device_fault() => return Err(e),
                    Err(e) => out.push(Err(e)),
                }
            }
            Ok(out)
        }
    }
}

/// The error that ends one request whose step failed with `e` (`what`: the operation). No room
/// for its next block is a capacity matter (another worker may continue it); anything else ends
/// this sequence (tagged `sequence`), naming the request.
pub fn sequence_error(request_id: &str, what: &str, e: EngineError) -> WorkerError {
    metrics::counter!(crate::cluster::metrics::names::SEQUENCE_FAILURES).increment(1);
    match e {
        EngineError::Pool(ferry_core::PoolError::Exhausted { .. }) => WorkerError::Exhausted(format!("request {request_id}: {what}: {e}")),
        e => WorkerError::SequenceFailed { request_id: request_id.to_string(), what: format!("{what}: {e}") },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::failure::WorkerFault;

    #[test]
    fn a_sequence_error_names_the_request_and_keeps_capacity_retryable() {
        let e = sequence_error("req-7", "decode step", EngineError::TokenOutOfRange { id: 9, vocab: 8 });
        assert_eq!(e.fault(), WorkerFault::Sequence);
        assert!(e.to_string().contains("request req-7: decode step: token id 9"), "{e}");
        let e = sequence_error("req-8", "decode step", EngineError::Pool(ferry_core::PoolError::Exhausted { requested: 1, free: 0, total: 4 }));
        assert_eq!(e.fault(), WorkerFault::Overloaded);
        assert!(e.to_string().contains("req-8"), "{e}");
    }
}
