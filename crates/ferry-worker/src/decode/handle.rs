//! The decode engine thread's handle ([`DecodeHandle`]): admit requests, attach cached
//! prefixes; and [`spawn`], which starts the thread and, if it fails, fails what it held.

use super::admission::{Admission, Cmd, DecodeEvent, HeldPrefix, Scheduling, Source};
use super::step::DecodeThread;
use crate::error::{Result, WorkerError};
use crate::facts::ModelFacts;
use crate::fault::{panic_message, EngineFault, FaultInjection};
use crate::load::LoadGauge;
use ferry_engine::Engine;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use tokio::sync::oneshot;

#[derive(Clone)]
pub struct DecodeHandle {
    tx: std_mpsc::Sender<Cmd>,
    pub load: Arc<LoadGauge>,
    pub facts: ModelFacts,
    pub scheduling: Scheduling,
    /// Set when the engine thread failed (see [`crate::fault`]).
    pub fault: Arc<EngineFault>,
}

impl DecodeHandle {
    pub fn admit(&self, a: Admission) -> Result<()> {
        self.tx.send(Cmd::Admit(a)).map_err(|_| WorkerError::ShuttingDown)
    }

    /// A new sequence on the longest prefix of `tokens` cached under `salt` (whole blocks, at most
    /// `max` tokens; nothing with the cache off), held until an admission takes it.
    pub async fn attach(&self, tokens: Vec<u32>, salt: Vec<u8>, max: usize) -> Result<HeldPrefix> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Cmd::Attach { tokens, salt, max, reply }).map_err(|_| WorkerError::ShuttingDown)?;
        let (seq, cached) = rx.await.map_err(|_| WorkerError::ShuttingDown)?;
        Ok(HeldPrefix::new(seq, cached, self.tx.clone()))
    }
}
pub fn spawn(engine: Engine, model: String, scheduling: Scheduling) -> DecodeHandle {
    spawn_with(engine, model, scheduling, FaultInjection::default())
}

/// [`spawn`], with failures injected on purpose (tests).
pub fn spawn_with(engine: Engine, model: String, scheduling: Scheduling, faults: FaultInjection) -> DecodeHandle {
    let (tx, rx) = std_mpsc::channel();
    let load = Arc::new(LoadGauge::default());
    load.blocks_total.store(engine.total_blocks() as u64, Relaxed);
    load.blocks_free.store(engine.free_blocks() as u64, Relaxed);
    load.block_size.store(engine.kv_layout().block_size as u64, Relaxed);
    let facts = ModelFacts::of(&engine, model);
    let fault = EngineFault::new();
    let handle = DecodeHandle { tx, load: load.clone(), facts, scheduling, fault: fault.clone() };
    let role = scheduling.role().as_str();
    std::thread::Builder::new()
        .name(format!("ferry-{role}"))
        .spawn(move || {
            let mut thread = DecodeThread::new(engine, load, scheduling, role, faults);
            let what = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| thread.run(&rx))) {
                Ok(Ok(())) => return,
                Ok(Err(e)) => format!("a {role} step failed at the backend: {e}"),
                Err(p) => format!("the {role} engine thread panicked: {}", panic_message(p.as_ref())),
            };
            tracing::error!("{what}: failing every request this worker holds and taking it out");
            fault.report(what.clone());
            thread.fail_all(&what);
            while let Ok(cmd) = rx.try_recv() {
                if let Cmd::Admit(a) = cmd {
                    fail_admission(a, &what);
                }
            }
        })
        .expect("spawn the engine thread");
    handle
}

/// An admission the failed engine never took: its request fails, tagged `engine`.
fn fail_admission(a: Admission, what: &str) {
    let e = WorkerError::EngineFailed(what.to_string());
    match a.source {
        Source::Kv { payload, imported, .. } => {
            let _ = imported.send((Err(e), payload));
        }
        Source::Prompt { .. } => {
            let _ = a.events.send(DecodeEvent::Failed(e));
        }
    }
}

