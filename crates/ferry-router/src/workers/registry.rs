//! The worker registry: one plain struct behind one mutex (never held across an `.await`).
//! Workers register (and get ids like `prefill-1`), renew a lease by heartbeat, and are marked
//! dead when the lease runs out or a call to them fails at the transport level. The router's own
//! per-worker in-flight accounting lives here too, held by [`InflightGuard`]s so every path
//! (success, error, cancellation) gives it back. So does the index of which worker holds which
//! KV blocks, fed by the heartbeats ([`kv`]).


use std::collections::{BTreeMap, HashMap};

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ferry_core::kv_index::KvIndex;
use ferry_core::routing::lease_expired;
use ferry_core::{KvDtype, WorkerRole, WorkerState};
use ferry_proto::v1;
use tokio::sync::{Notify, watch};

use crate::RouterError;
use crate::workers::dial::{self, DialOptions, WorkerChannel};
use crate::workers::prefix_index as kv;
use crate::wire::{role_from_wire, role_to_wire, state_to_wire};

/// One registered worker.
#[derive(Clone, Debug)]
pub struct Worker {
    pub id: String,
    pub name: String,
    pub role: WorkerRole,
    pub state: WorkerState,
    pub grpc_addr: String,
    pub data_addr: String,
    pub model: String,
    pub max_context: u32,
    pub load: v1::WorkerLoad,
    pub last_heartbeat: Instant,
    pub inflight: u32,
    pub outstanding_prefill_tokens: u64,
    /// Decode workers: KV blocks the requests in flight there were admitted for.
    pub promised_blocks: u64,
    /// The worker itself is draining to exit (SIGTERM): admins cannot undrain it.
    pub shutting_down: bool,
    /// The KV transports it can use (defaults filled in for workers that registered none).
    pub kv_transports: Vec<v1::KvTransport>,
    /// It keeps a prefix cache and sends its cache events with its heartbeats.
    pub prefix_cache: bool,
    /// What its KV cache stores (its cache blocks' hashes depend on it).
    pub kv_dtype: KvDtype,
    /// Bytes of K and V one token takes in its cache (0: the worker did not say).
    pub kv_bytes_per_token: u64,
    /// Lazily connected, carrying the cluster secret; cached for the worker's life.
    pub channel: WorkerChannel,
    /// Turns true when the worker is marked dead (lease expired, a call found it gone) or
    /// leaves: every call in flight to it ends then, and its requests move.
    pub gone: Arc<watch::Sender<bool>>,
}

impl Worker {
    /// Resolves once the worker is dead or gone from the registry (at once if it already is).
    pub fn gone(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.gone.subscribe();
        async move {
            let _ = rx.wait_for(|g| *g).await;
        }
    }
}

impl Worker {
    pub fn info(&self, now: Instant) -> v1::WorkerInfo {
        v1::WorkerInfo {
            worker_id: self.id.clone(),
            name: self.name.clone(),
            role: role_to_wire(self.role) as i32,
            state: state_to_wire(self.state) as i32,
            grpc_addr: self.grpc_addr.clone(),
            data_addr: self.data_addr.clone(),
            load: Some(self.load),
            inflight: self.inflight,
            outstanding_prefill_tokens: self.outstanding_prefill_tokens,
            promised_kv_blocks: self.promised_blocks,
            shutting_down: self.shutting_down,
            kv_transports: self.kv_transports.iter().map(|&k| k as i32).collect(),
            kv_dtype: self.kv_dtype.to_string(),
            kv_bytes_per_token: self.kv_bytes_per_token,
            since_heartbeat_ms: now
                .saturating_duration_since(self.last_heartbeat)
                .as_secs_f64()
                * 1e3,
        }
    }
}

#[derive(Default)]
pub(super) struct Members {
    pub(super) workers: BTreeMap<String, Worker>,
    pub(super) next_id: HashMap<WorkerRole, u64>,
    pub(super) fingerprint: Option<String>,
    /// Which worker holds which KV blocks (live workers only).
    pub(super) kv: KvIndex<u64>,
}

/// What a heartbeat's answer says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeartbeatAnswer {
    pub state: WorkerState,
    /// The index missed some of the worker's cache events: it should send a snapshot.
    pub kv_resync: bool,
}

pub struct Registry {
    inner: Mutex<Members>,
    pub lease: Duration,
    pub heartbeat: Duration,
    dial: DialOptions,
    /// Woken whenever room may have appeared on a decode worker (a request ended, a worker
    /// registered or reported its load): the admission queue's head looks again.
    pub room: Arc<Notify>,
}

impl Registry {
    pub fn new(lease: Duration, heartbeat: Duration, dial: DialOptions) -> Registry {
        Registry {
            inner: Mutex::new(Members::default()),
            lease,
            heartbeat,
            dial,
            room: Arc::new(Notify::new()),
        }
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Members> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a worker; the first fingerprint becomes the pool's. A dead entry at the same address
    /// is replaced.
    pub fn register(&self, req: &v1::RegisterRequest) -> Result<v1::RegisterResponse, RouterError> {
        let role = role_from_wire(req.role)
            .ok_or_else(|| RouterError::BadRegistration("role is unspecified".into()))?;
        if req.grpc_addr.is_empty() {
            return Err(RouterError::BadRegistration("grpc_addr is empty".into()));
        }
        let kv_dtype = match req.kv_dtype.as_str() {
            "" => KvDtype::F32,
            name => KvDtype::from_layout_name(name).map_err(|e| RouterError::BadRegistration(format!("kv_dtype: {e}")))?,
        };
        let channel = dial::channel(&req.grpc_addr, &self.dial)?;
        let mut inner = self.lock();
        match &inner.fingerprint {
            Some(pool) if *pool != req.fingerprint => {
                return Err(RouterError::FingerprintMismatch {
                    worker: if req.name.is_empty() {
                        req.grpc_addr.clone()
                    } else {
                        req.name.clone()
                    },
                    worker_fingerprint: req.fingerprint.clone(),
                    pool_fingerprint: pool.clone(),
                });
            }
            Some(_) => {}
            None => inner.fingerprint = Some(req.fingerprint.clone()),
        }
        let replaced: Vec<String> = inner
            .workers
            .values()
            .filter(|w| w.state == WorkerState::Dead && w.grpc_addr == req.grpc_addr)
            .map(|w| w.id.clone())
            .collect();
        for id in &replaced {
            inner.workers.remove(id);
            kv::forget(&mut inner.kv, id);
        }
        let n = inner.next_id.entry(role).or_insert(0);
        *n += 1;
        let id = format!("{role}-{n}");
        let worker = Worker {
            id: id.clone(),
            name: req.name.clone(),
            role,
            state: if req.draining {
                WorkerState::Draining
            } else {
                WorkerState::Ready
            },
            grpc_addr: req.grpc_addr.clone(),
            data_addr: req.data_addr.clone(),
            model: req.model.clone(),
            max_context: req.max_context,
            load: req.load.unwrap_or_default(),
            last_heartbeat: Instant::now(),
            inflight: 0,
            outstanding_prefill_tokens: 0,
            promised_blocks: 0,
            shutting_down: req.draining,
            kv_transports: crate::workers::transport::registered(&req.kv_transports, role == WorkerRole::Prefill, &req.data_addr),
            prefix_cache: req.prefix_cache,
            kv_dtype,
            kv_bytes_per_token: req.kv_bytes_per_token,
            channel,
            gone: Arc::new(watch::channel(false).0),
        };
        inner.workers.insert(id.clone(), worker);
        drop(inner);
        self.room.notify_waiters();
        tracing::info!(worker = %id, addr = %req.grpc_addr, "worker registered");
        Ok(v1::RegisterResponse {
            worker_id: id,
            lease_ms: self.lease.as_millis().min(u32::MAX as u128) as u32,
            heartbeat_ms: self.heartbeat.as_millis().min(u32::MAX as u128) as u32,
        })
    }

    /// Renews a lease and applies the worker's cache events. Unknown or dead workers get
    /// `UnknownWorker` (NOT_FOUND: register again); a dead entry is forgotten so the new
    /// registration starts clean.
    pub fn heartbeat(&self, req: &v1::HeartbeatRequest, now: Instant) -> Result<HeartbeatAnswer, RouterError> {
        let mut inner = self.lock();
        let Members { workers, kv: index, .. } = &mut *inner;
        let Some(w) = workers.get_mut(&req.worker_id) else {
            return Err(RouterError::UnknownWorker(req.worker_id.clone()));
        };
        if !req.grpc_addr.is_empty() && req.grpc_addr != w.grpc_addr {
            // The id was handed out again by this router (it restarted) to another worker.
            return Err(RouterError::UnknownWorker(req.worker_id.clone()));
        }
        if w.state == WorkerState::Dead {
            workers.remove(&req.worker_id);
            kv::forget(index, &req.worker_id);
            return Err(RouterError::UnknownWorker(req.worker_id.clone()));
        }
        w.last_heartbeat = now;
        if let Some(load) = req.load {
            w.load = load;
        }
        if req.draining && !w.shutting_down {
            w.shutting_down = true;
            w.state = WorkerState::Draining;
            tracing::info!(worker = %w.id, "worker is draining to shut down: no new requests go to it");
        }
        let state = w.state;
        let applied = kv::apply(index, &req.worker_id, req.kv_events.as_ref());
        let distinct = index.distinct_blocks();
        drop(inner);
        if req.kv_events.is_some() {
            kv::record(&req.worker_id, applied, distinct);
        }
        self.room.notify_waiters();
        Ok(HeartbeatAnswer { state, kv_resync: applied.resync })
    }

    /// Marks every worker whose lease ran out at `now` dead; returns their ids.
    pub fn sweep(&self, now: Instant) -> Vec<String> {
        let mut inner = self.lock();
        let mut expired = Vec::new();
        let Members { workers, kv: index, .. } = &mut *inner;
        for w in workers.values_mut() {
            let since = now.saturating_duration_since(w.last_heartbeat);
            if w.state != WorkerState::Dead && lease_expired(Duration::ZERO, since, self.lease) {
                w.state = WorkerState::Dead;
                w.gone.send_replace(true);
                kv::forget(index, &w.id);
                expired.push(w.id.clone());
            }
        }
        drop(inner);
        for id in &expired {
            tracing::warn!(worker = %id, "lease expired: worker marked dead");
            metrics::counter!(crate::metrics::names::WORKERS_MARKED_DEAD, "cause" => "lease_expired")
                .increment(1);
        }
        expired
    }

    /// A call to the worker failed at the transport level: never route to it again until it
    /// registers anew.
    pub fn mark_dead(&self, id: &str, why: &str) {
        let mut inner = self.lock();
        let Members { workers, kv: index, .. } = &mut *inner;
        if let Some(w) = workers.get_mut(id)
            && w.state != WorkerState::Dead
        {
            w.state = WorkerState::Dead;
            w.gone.send_replace(true);
            kv::forget(index, id);
            tracing::warn!(worker = %id, reason = why, "worker marked dead");
            metrics::counter!(crate::metrics::names::WORKERS_MARKED_DEAD, "cause" => "call_failed")
                .increment(1);
        }
    }

    /// A worker refused a request because it is draining (it may not have told us yet): stop
    /// routing to it. Its own heartbeat confirms the drain.
    pub fn mark_draining(&self, id: &str) {
        if let Some(w) = self.lock().workers.get_mut(id)
            && w.state == WorkerState::Ready
        {
            w.state = WorkerState::Draining;
            w.shutting_down = true;
            tracing::info!(worker = %id, "worker refused a request while draining: no new requests go to it");
        }
    }

    /// A worker that finished draining leaves (idempotent: unknown ids are fine).
    /// A worker leaves the pool. With `addr` (the worker's own call), only the entry registered
    /// from that address: a restarted router may have given the id to another worker.
    pub fn deregister(&self, id: &str, addr: &str) {
        let mut inner = self.lock();
        if !addr.is_empty() && inner.workers.get(id).is_some_and(|w| w.grpc_addr != addr) {
            return;
        }
        if let Some(w) = inner.workers.remove(id) {
            w.gone.send_replace(true);
            kv::forget(&mut inner.kv, id);
            tracing::info!(worker = %id, "worker drained and deregistered");
        }
    }

    pub fn drain(&self, id: &str) -> Result<v1::WorkerInfo, RouterError> {
        self.update(id, |w| {
            if w.state == WorkerState::Ready {
                w.state = WorkerState::Draining;
            }
        })
    }

    pub fn undrain(&self, id: &str) -> Result<v1::WorkerInfo, RouterError> {
        let mut inner = self.lock();
        let w = inner
            .workers
            .get_mut(id)
            .ok_or_else(|| RouterError::UnknownWorker(id.into()))?;
        if w.shutting_down {
            return Err(RouterError::ShuttingDown(id.into()));
        }
        if w.state == WorkerState::Draining {
            w.state = WorkerState::Ready;
        }
        Ok(w.info(Instant::now()))
    }

    pub fn remove(&self, id: &str) -> Result<v1::WorkerInfo, RouterError> {
        let mut inner = self.lock();
        let w = inner
            .workers
            .remove(id)
            .ok_or_else(|| RouterError::UnknownWorker(id.into()))?;
        kv::forget(&mut inner.kv, id);
        drop(inner);
        w.gone.send_replace(true);
        Ok(w.info(Instant::now()))
    }

    fn update(&self, id: &str, f: impl FnOnce(&mut Worker)) -> Result<v1::WorkerInfo, RouterError> {
        let mut inner = self.lock();
        let w = inner
            .workers
            .get_mut(id)
            .ok_or_else(|| RouterError::UnknownWorker(id.into()))?;
        f(w);
        Ok(w.info(Instant::now()))
    }

    pub fn list(&self) -> Vec<v1::WorkerInfo> {
        let now = Instant::now();
        self.lock().workers.values().map(|w| w.info(now)).collect()
    }

    /// Every worker's priced-step counters (`WorkerLoad.step_seconds`, `step_model_seconds`) as
    /// its last heartbeat carried them, for the autoscaler's [`ferry_core::autoscale::Calibrator`].
    pub fn step_clocks(&self) -> Vec<(String, WorkerRole, f64, f64)> {
        self.lock().workers.values().map(|w| (w.id.clone(), w.role, w.load.step_seconds, w.load.step_model_seconds)).collect()
    }

    pub fn get(&self, id: &str) -> Option<Worker> {
        self.lock().workers.get(id).cloned()
    }

    pub fn fingerprint(&self) -> Option<String> {
        self.lock().fingerprint.clone()
    }

    /// The smallest context among live workers (`None` with none registered).
    pub fn max_context(&self) -> Option<u32> {
        self.lock()
            .workers
            .values()
            .filter(|w| w.state != WorkerState::Dead)
            .map(|w| w.max_context)
            .min()
    }
}

#[cfg(test)]
#[path = "registry_tests.rs"]
mod tests;
