//! The prefill engine thread's handle ([`PrefillHandle`]: queue a prompt, or refuse it when the
//! queue is full) and its start ([`spawn`]): a thread that fails every request it holds and
//! takes the worker out when a step fails at the backend or panics.

use crate::error::{Result, WorkerError};
use crate::facts::ModelFacts;
use crate::fault::{panic_message, EngineFault};
use crate::kv::send::Outbound;
use crate::load::LoadGauge;
use crate::prefill::admission::{Cmd, PrefillJob, PrefillOptions};
use crate::prefill::engine_thread::PrefillThread;
use ferry_engine::Engine;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;

#[derive(Clone)]
pub struct PrefillHandle {
    tx: std_mpsc::Sender<Cmd>,
    pub load: Arc<LoadGauge>,
    pub facts: ModelFacts,
    queue_max: usize,
    /// Set when the engine thread failed (see [`crate::fault`]).
    pub fault: Arc<EngineFault>,
}

impl PrefillHandle {
    /// Queue a prompt, or refuse it (tagged `overloaded`) when `queue_max` prompts already wait.
    pub fn submit(&self, job: PrefillJob) -> Result<()> {
        let max = self.queue_max as u64;
        if self.load.waiting_requests.fetch_update(Relaxed, Relaxed, |w| (w < max).then_some(w + 1)).is_err() {
            metrics::counter!(crate::cluster::metrics::names::REFUSALS, "role" => "prefill", "reason" => "queue_full").increment(1);
            return Err(WorkerError::Exhausted(format!("the prefill queue is full: {max} prompts wait to start (--queue-max {max})")));
        }
        self.load.queued_prefill_tokens.fetch_add(job.prompt.len() as u64, Relaxed);
        self.load.queued_requests.fetch_add(1, Relaxed);
        self.tx.send(Cmd::Job(job)).map_err(|_| {
            self.load.waiting_requests.fetch_sub(1, Relaxed);
            WorkerError::ShuttingDown
        })
    }
}

/// Start the engine thread.
pub fn spawn(engine: Engine, model: String) -> PrefillHandle {
    spawn_with(engine, model, PrefillOptions::default())
}

/// [`spawn`] with these options.
pub fn spawn_with(engine: Engine, model: String, opts: PrefillOptions) -> PrefillHandle {
    let (tx, rx) = std_mpsc::channel();
    let load = Arc::new(LoadGauge::default());
    let facts = ModelFacts::of(&engine, model);
    let fault = EngineFault::new();
    let handle = PrefillHandle { tx: tx.clone(), load: load.clone(), facts, queue_max: opts.queue_max.max(1), fault: fault.clone() };
    std::thread::Builder::new()
        .name("ferry-prefill".into())
        .spawn(move || {
            let mut thread = PrefillThread::new(engine, load, opts.faults);
            let what = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| thread.run(&rx, &tx))) {
                Ok(Ok(())) => return,
                Ok(Err(e)) => format!("a prefill step failed at the backend: {e}"),
                Err(p) => format!("the prefill engine thread panicked: {}", panic_message(p.as_ref())),
            };
            tracing::error!("{what}: failing every request this worker holds and taking it out");
            fault.report(what.clone());
            let fail = |j: PrefillJob| {
                let _ = j.out.send(Outbound::Failed(WorkerError::EngineFailed(what.clone())));
            };
            thread.take_jobs().into_iter().for_each(fail);
            while let Ok(cmd) = rx.try_recv() {
                if let Cmd::Job(j) = cmd {
                    fail(j);
                }
            }
        })
        .expect("spawn the prefill engine thread");
    handle
}

