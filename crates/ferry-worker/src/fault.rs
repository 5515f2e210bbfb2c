//! A worker whose engine broke takes itself out. The engine thread runs its loop under
//! `catch_unwind`; when the loop panics, or a step fails at the backend (the device is gone, a
//! CUDA call failed: [`ferry_engine::EngineError::is_device_fault`]), the thread fails every
//! request it holds with a status tagged `engine` (the router moves them), reports here, and
//! exits. [`crate::serve`] sees the report: `/readyz` answers 503 naming the fault, the worker
//! deregisters from every router, lets the failed streams reach their callers, and returns
//! [`WorkerError::EngineFailed`](crate::WorkerError::EngineFailed); `ferry prefill|decode` then
//! exits with [`EXIT_ENGINE_FAILED`]. No zombie stays registered.
//!
//! [`FaultInjection`] holds the test hooks that make this happen on purpose.

use std::sync::Arc;
use tokio::sync::watch;

/// The exit code of a worker process whose engine failed (EX_SOFTWARE).
pub const EXIT_ENGINE_FAILED: i32 = 70;

/// The engine's fatal fault, once there is one (set once; later reports are ignored).
pub struct EngineFault {
    tx: watch::Sender<Option<String>>,
}

impl EngineFault {
    pub fn new() -> Arc<EngineFault> {
        Arc::new(EngineFault { tx: watch::channel(None).0 })
    }

    /// Record the fault (the first one wins).
    pub fn report(&self, what: String) {
        self.tx.send_if_modified(|v| {
            if v.is_none() {
                *v = Some(what);
                true
            } else {
                false
            }
        });
    }

    /// The fault, if the engine has failed.
    pub fn get(&self) -> Option<String> {
        self.tx.borrow().clone()
    }

    pub fn subscribe(&self) -> watch::Receiver<Option<String>> {
        self.tx.subscribe()
    }

    /// Wait until the engine fails; returns what failed.
    pub async fn wait(&self) -> String {
        let mut rx = self.tx.subscribe();
        let got = rx.wait_for(Option::is_some).await.map(|v| v.clone().unwrap_or_default());
        match got {
            Ok(what) => what,
            // The sender lives in `self`: never dropped while this borrows it.
            Err(_) => std::future::pending().await,
        }
    }
}

/// A panic's message (`panic!` with a literal or a formatted string), for the log and the status.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Failures injected on purpose, for the tests of the paths above. Only built with the `testing`
/// feature (the worker's own tests turn it on; a shipped `ferry` binary has it only when built with
/// `--features testing`); [`FaultInjection::from_env`] then reads the hidden environment variables:
/// - `FERRY_FAULT_PANIC_AFTER_STEPS=N`: the engine thread panics at its step N+1 (after N
///   steps have run);
/// - `FERRY_FAULT_FAIL_REQUEST=ID`: the request with this id fails in its first decode step
///   shared with other sequences once it has two tokens (its step item carries a token id
///   outside the vocabulary, so the batched step fails and the culprit is isolated), while the
///   rest of its batch goes on;
/// - `FERRY_FAULT_SPEC_GARBAGE=1`: with speculation on, every sequence proposes as many tokens as
///   a step may carry, and they are garbage (the output must not change).
#[cfg(feature = "testing")]
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultInjection {
    pub panic_after_steps: Option<u64>,
    pub fail_request: Option<String>,
    pub spec_garbage: bool,
}

#[cfg(feature = "testing")]
impl FaultInjection {
    pub const PANIC_AFTER_STEPS: &'static str = "FERRY_FAULT_PANIC_AFTER_STEPS";
    pub const FAIL_REQUEST: &'static str = "FERRY_FAULT_FAIL_REQUEST";
    pub const SPEC_GARBAGE: &'static str = "FERRY_FAULT_SPEC_GARBAGE";

    /// The hooks set in this process's environment (read once, at worker start).
    pub fn from_env() -> FaultInjection {
        let panic_after_steps = std::env::var(Self::PANIC_AFTER_STEPS).ok().and_then(|v| v.trim().parse().ok());
        let fail_request = std::env::var(Self::FAIL_REQUEST).ok().filter(|v| !v.is_empty());
        let spec_garbage = std::env::var(Self::SPEC_GARBAGE).is_ok_and(|v| v.trim() == "1");
        if panic_after_steps.is_some() || fail_request.is_some() || spec_garbage {
            tracing::warn!(?panic_after_steps, ?fail_request, spec_garbage, "fault injection is on (test hooks)");
        }
        FaultInjection { panic_after_steps, fail_request, spec_garbage }
    }

    /// Panics when `steps` (counted before this step) reaches the configured count.
    pub fn before_step(&self, steps: u64) {
        if let Some(n) = self.panic_after_steps.filter(|&n| steps >= n) {
            panic!("injected fault: {}={n}", Self::PANIC_AFTER_STEPS);
        }
    }

    /// Whether this decode step of `request_id` (with `count` tokens generated) is made to fail.
    pub fn fails(&self, request_id: &str, count: usize) -> bool {
        count >= 2 && self.fail_request.as_deref() == Some(request_id)
    }

    /// With `spec_garbage`: replace `drafts` with `n` ids that no proposer would make (drawn from
    /// `seed`, below `vocab`) and return true; false: proposals stay as they are.
    pub fn garble(&self, drafts: &mut Vec<u32>, n: usize, vocab: u32, seed: u64) -> bool {
        if !self.spec_garbage {
            return false;
        }
        drafts.clear();
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        for _ in 0..n {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            drafts.push((x % u64::from(vocab)) as u32);
        }
        true
    }
}

/// Without the `testing` feature there are no hooks: nothing is read from the environment, and
/// the step loops' checks are empty inline functions the compiler removes (as candle's dummy CUDA
/// backend keeps the call sites compiling without the feature).
#[cfg(not(feature = "testing"))]
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultInjection;

#[cfg(not(feature = "testing"))]
impl FaultInjection {
    /// No hooks: reads nothing (built without the `testing` feature).
    pub fn from_env() -> FaultInjection {
        FaultInjection
    }

    #[inline(always)]
    pub fn before_step(&self, _steps: u64) {}

    #[inline(always)]
    pub fn fails(&self, _request_id: &str, _count: usize) -> bool {
        false
    }

    #[inline(always)]
    pub fn garble(&self, _drafts: &mut Vec<u32>, _n: usize, _vocab: u32, _seed: u64) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_first_fault_wins_and_wakes_the_waiter() {
        let f = EngineFault::new();
        assert_eq!(f.get(), None);
        let f2 = f.clone();
        let waiter = tokio::spawn(async move { f2.wait().await });
        f.report("device lost".into());
        f.report("later".into());
        assert_eq!(waiter.await.expect("join"), "device lost");
        assert_eq!(f.get().as_deref(), Some("device lost"));
    }

    #[test]
    fn panic_messages_are_read_back() {
        let p = std::panic::catch_unwind(|| panic!("boom {}", 7)).unwrap_err();
        assert_eq!(panic_message(p.as_ref()), "boom 7");
        let p = std::panic::catch_unwind(|| panic!("static")).unwrap_err();
        assert_eq!(panic_message(p.as_ref()), "static");
    }
}
