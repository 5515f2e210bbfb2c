//! What a worker's `/livez` and `/readyz` report (for Kubernetes probes and load balancers).
//!
//! Live: the process serves HTTP. Ready: the model is loaded, the engine has not failed, the
//! worker is not draining, and, when it has routers, it is registered with at least one and that
//! lease is current (a heartbeat was acknowledged within the lease). A worker whose engine failed
//! answers 503 naming the fault while it takes itself out ([`crate::fault`]). A draining worker answers 503 so that a Kubernetes Service or load balancer
//! stops sending it work while it finishes what it holds.
//! [`registration`](super::registration) flips the registered flag both ways; the HTTP listener
//! may start before the model loads, so a probe sees "loading the model" rather than a refused
//! connection.

use crate::load::LoadGauge;
use crate::role::Role;
use std::sync::{Arc, OnceLock};
use tokio::sync::watch;

/// The engine as the HTTP handlers see it once it is up: its load gauge and role.
#[derive(Clone)]
pub struct EngineView {
    pub load: Arc<LoadGauge>,
    pub role: Role,
}

/// A worker's health, shared by the process and its HTTP listener (cheap to clone).
#[derive(Clone)]
pub struct Health {
    router: Option<String>,
    registered: watch::Receiver<bool>,
    engine: Arc<OnceLock<EngineView>>,
    /// The drain flag of the worker these probes describe, once it serves.
    draining: Arc<OnceLock<watch::Receiver<bool>>>,
    /// The engine's fatal fault, once it serves.
    fault: Arc<OnceLock<Arc<crate::fault::EngineFault>>>,
}

impl Health {
    /// `registered` is the receiving side of the flag given to [`crate::serve`].
    pub fn new(router: Option<String>, registered: watch::Receiver<bool>) -> Health {
        Health { router, registered, engine: Arc::new(OnceLock::new()), draining: Arc::new(OnceLock::new()), fault: Arc::new(OnceLock::new()) }
    }

    /// Follow the engine's fault: not ready once it failed.
    pub fn follow_fault(&self, fault: Arc<crate::fault::EngineFault>) {
        let _ = self.fault.set(fault);
    }

    /// Follow the worker's drain flag (see [`super::drain::Drain::subscribe`]): not ready once it
    /// turns true.
    pub fn follow_drain(&self, draining: watch::Receiver<bool>) {
        let _ = self.draining.set(draining);
    }

    /// The model is loaded and the engine thread runs.
    pub fn engine_started(&self, view: EngineView) {
        let _ = self.engine.set(view);
    }

    pub fn engine(&self) -> Option<&EngineView> {
        self.engine.get()
    }

    /// Ok when ready, else the one-line reason.
    pub fn readiness(&self) -> Result<(), String> {
        let draining = self.draining.get().is_some_and(|d| *d.borrow());
        let failed = self.fault.get().and_then(|f| f.get());
        readiness(self.engine.get().is_some(), failed.as_deref(), *self.registered.borrow(), draining, self.router.as_deref())
    }
}

/// The readiness decision, apart from where its inputs come from. `router`: the `--router` list.
pub fn readiness(model_loaded: bool, engine_failed: Option<&str>, registered: bool, draining: bool, router: Option<&str>) -> Result<(), String> {
    if !model_loaded {
        return Err("loading the model".into());
    }
    if let Some(what) = engine_failed {
        return Err(format!("the engine failed ({what}): the worker is taking itself out"));
    }
    if draining {
        return Err("draining: finishing the requests it holds, taking no new ones".into());
    }
    match (registered, router) {
        (true, _) => Ok(()),
        (false, Some(r)) if !r.contains(',') => Err(format!("not registered with the router at {r} (registering, or its lease lapsed)")),
        (false, Some(r)) => Err(format!("not registered with any of the routers at {r} (registering, or their leases lapsed)")),
        (false, None) => Err("not serving yet".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_needs_the_model_and_a_current_registration() {
        let r = Some("router:7700");
        let draining = "draining: finishing the requests it holds, taking no new ones";
        let cases: &[(bool, bool, bool, Option<&str>, Result<(), &str>)] = &[
            (false, false, false, r, Err("loading the model")),
            (false, true, false, r, Err("loading the model")),
            (true, false, false, r, Err("not registered with the router at router:7700 (registering, or its lease lapsed)")),
            (true, true, false, r, Ok(())),
            (true, true, false, None, Ok(())),
            (true, false, false, None, Err("not serving yet")),
            (true, true, true, r, Err(draining)),
            (true, false, true, r, Err(draining)),
            (true, true, true, None, Err(draining)),
            (true, false, false, Some("a:1, b:2"), Err("not registered with any of the routers at a:1, b:2 (registering, or their leases lapsed)")),
        ];
        for (loaded, registered, drain, router, want) in cases {
            let got = readiness(*loaded, None, *registered, *drain, *router);
            assert_eq!(got.as_ref().map_err(String::as_str), want.as_ref().map_err(|s| *s), "{loaded} {registered} {drain} {router:?}");
        }
        // A failed engine wins over everything but loading.
        let failed = readiness(true, Some("the decode engine thread panicked: boom"), true, false, r);
        assert_eq!(failed, Err("the engine failed (the decode engine thread panicked: boom): the worker is taking itself out".into()));
        assert_eq!(readiness(false, Some("x"), true, false, r), Err("loading the model".into()));
    }
}
