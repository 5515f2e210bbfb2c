//! The worker registry: one plain struct behind one mutex (never held across an `.await`).
//! Workers register (and get ids like `prefill-1`), renew a lease by heartbeat, and are marked
//! dead when the lease runs out or a call to them fails at the transport level. The router's own
//! per-worker in-flight accounting lives here too, held by [`InflightGuard`]s so every path
//! (success, error, cancellation) gives it back. So does the index of which worker holds which
//! KV blocks, fed by the heartbeats ([`kv`]).


use std::collections::{BTreeMap, HashMap};

use ferry_core::prefix_cache::{BlockHash, block_hashes};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ferry_core::kv_index::KvIndex;
use ferry_core::routing::{DecodeCandidate, PrefillCandidate, lease_expired};
use ferry_core::{WorkerRole, WorkerState};
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
            since_heartbeat_ms: now
                .saturating_duration_since(self.last_heartbeat)
                .as_secs_f64()
                * 1e3,
        }
    }
}

#[derive(Default)]
struct Members {
    workers: BTreeMap<String, Worker>,
    next_id: HashMap<WorkerRole, u64>,
    fingerprint: Option<String>,
    /// Which worker holds which KV blocks (live workers only).
    kv: KvIndex<u64>,
}

/// Ready workers per role ([`Registry::ready`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ready {
    pub prefill: u32,
    pub decode: u32,
    pub colocated: u32,
}

impl Ready {
    /// Whether workers ready in these numbers can serve a request: a prefill and a decode worker,
    /// or a colocated one. gRPC `Health`, HTTP `/health` and [`crate::pipeline::start`] all ask this.
    pub fn can_serve(self) -> bool {
        (self.prefill > 0 && self.decode > 0) || self.colocated > 0
    }
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

    fn lock(&self) -> MutexGuard<'_, Members> {
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
            metrics::counter!("ferry_router_workers_marked_dead_total", "cause" => "lease_expired")
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
            metrics::counter!("ferry_router_workers_marked_dead_total", "cause" => "call_failed")
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

    /// Ready workers per role.
    pub fn ready(&self) -> Ready {
        let inner = self.lock();
        let n = |r| {
            inner
                .workers
                .values()
                .filter(|w| w.role == r && w.state == WorkerState::Ready)
                .count() as u32
        };
        Ready { prefill: n(WorkerRole::Prefill), decode: n(WorkerRole::Decode), colocated: n(WorkerRole::Colocated) }
    }

    /// Workers per (role, state), every combination present (for gauges).
    pub fn counts(&self) -> Vec<(WorkerRole, WorkerState, u32)> {
        let inner = self.lock();
        let mut out = Vec::new();
        for role in [
            WorkerRole::Prefill,
            WorkerRole::Decode,
            WorkerRole::Colocated,
        ] {
            for state in WorkerState::ALL {
                let n = inner
                    .workers
                    .values()
                    .filter(|w| w.role == role && w.state == state)
                    .count() as u32;
                out.push((role, state, n));
            }
        }
        out
    }

    /// Prefill candidates (in id order) for [`ferry_core::routing::pick_prefill`].
    pub fn prefill_candidates(&self) -> Vec<PrefillCandidate> {
        self.lock()
            .workers
            .values()
            .filter(|w| w.role == WorkerRole::Prefill)
            .map(|w| PrefillCandidate {
                id: w.id.clone(),
                state: w.state,
                inflight: w.inflight,
                outstanding_tokens: w.outstanding_prefill_tokens,
                reported_queue_tokens: w.load.queued_prefill_tokens,
                tokens_per_s: w.load.prefill_tokens_per_s,
            })
            .collect()
    }

    /// Candidates of `role` (decode or colocated: both admit by KV blocks) and the smallest block
    /// size among the ready ones (0 if unknown).
    pub fn decode_candidates(&self, role: WorkerRole) -> (Vec<DecodeCandidate>, u32) {
        let inner = self.lock();
        let decode = inner.workers.values().filter(|w| w.role == role);
        let block_size = decode
            .clone()
            .filter(|w| w.state == WorkerState::Ready)
            .map(|w| w.load.block_size)
            .min()
            .unwrap_or(0);
        let cands = decode
            .map(|w| DecodeCandidate {
                id: w.id.clone(),
                state: w.state,
                total_blocks: w.load.kv_blocks_total,
                free_blocks: w.load.kv_blocks_free,
                reserved_blocks: w.load.kv_blocks_reserved,
                active_sequences: w.load.active_sequences,
                router_inflight: w.inflight,
                router_promised_blocks: w.promised_blocks.min(u32::MAX as u64) as u32,
            })
            .collect();
        (cands, block_size)
    }

    fn adjust(&self, id: &str, inflight: i64, tokens: i64, blocks: i64) {
        if let Some(w) = self.lock().workers.get_mut(id) {
            w.inflight = (w.inflight as i64 + inflight).max(0) as u32;
            w.outstanding_prefill_tokens =
                (w.outstanding_prefill_tokens as i64 + tokens).max(0) as u64;
            w.promised_blocks = (w.promised_blocks as i64 + blocks).max(0) as u64;
        }
        if inflight < 0 {
            self.room.notify_waiters();
        }
    }
}

/// One request in flight on one worker (and, for prefill, its prompt tokens): counted while the
/// guard lives, given back on drop, whatever path the request takes.
pub struct InflightGuard {
    registry: Arc<Registry>,
    worker: String,
    tokens: u64,
    blocks: u64,
}

impl InflightGuard {
    /// A prefill request of `tokens` prompt tokens.
    pub fn new(registry: &Arc<Registry>, worker: &str, tokens: u64) -> InflightGuard {
        registry.adjust(worker, 1, tokens as i64, 0);
        InflightGuard {
            registry: registry.clone(),
            worker: worker.into(),
            tokens,
            blocks: 0,
        }
    }

    /// A decode request admitted for `blocks` KV blocks.
    pub fn decode(registry: &Arc<Registry>, worker: &str, blocks: u64) -> InflightGuard {
        registry.adjust(worker, 1, 0, blocks as i64);
        InflightGuard {
            registry: registry.clone(),
            worker: worker.into(),
            tokens: 0,
            blocks,
        }
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.registry.adjust(
            &self.worker,
            -1,
            -(self.tokens as i64),
            -(self.blocks as i64),
        );
    }
}

/// The prefix index ([`kv`]) as the pipeline asks it.
impl Registry {
    /// How many of `chain`'s leading blocks worker `worker_id` holds, as its events tell (0 for a
    /// worker the index does not know or does not trust until its snapshot comes).
    pub fn prefix_held(&self, worker_id: &str, chain: &[u64]) -> usize {
        self.lock().kv.overlap(worker_id, chain)
    }

    /// For every worker holding at least `chain`'s first block: how many leading blocks it holds.
    pub fn prefix_overlaps(&self, chain: &[u64]) -> HashMap<String, usize> {
        self.lock().kv.overlaps(chain)
    }

    /// Blocks the index has worker `worker_id` holding.
    pub fn prefix_blocks(&self, worker_id: &str) -> usize {
        self.lock().kv.blocks_of(worker_id)
    }

    /// A request's block chain as the workers hash it: the full blocks of `tokens` (of
    /// `block_size` tokens) under the pool's model fingerprint and the request's cache `salt`
    /// (empty: shared by all). Empty before any worker registered (no fingerprint yet).
    pub fn prefix_chain(&self, salt: &[u8], tokens: &[u32], block_size: usize) -> Vec<u64> {
        let Some(fp) = self.fingerprint() else { return Vec::new() };
        if block_size == 0 {
            return Vec::new();
        }
        block_hashes(BlockHash::root(fp.as_bytes(), salt), tokens, block_size).into_iter().map(|h| h.0).collect()
    }
}


#[cfg(test)]
mod tests {
    use super::*;

    fn reg_req(role: v1::WorkerRole, addr: &str, fp: &str) -> v1::RegisterRequest {
        v1::RegisterRequest {
            role: role as i32,
            grpc_addr: addr.into(),
            fingerprint: fp.into(),
            max_context: 2048,
            ..Default::default()
        }
    }

    fn registry() -> Registry {
        Registry::new(
            Duration::from_secs(3),
            Duration::from_secs(1),
            DialOptions {
                connect_timeout: Duration::from_secs(1),
                tls: None,
                cluster: Default::default(),
            },
        )
    }

    // A restarted router hands ids out afresh: the worker that re-registers first may get the
    // id another worker still heart-beats with. That heartbeat must not renew the other's entry
    // (it would never register again, and the router would list one worker for two), and its
    // deregistration must not remove it.
    #[tokio::test]
    async fn an_id_handed_out_again_answers_only_its_own_worker() {
        let r = registry();
        let id = r
            .register(&reg_req(v1::WorkerRole::Prefill, "127.0.0.1:2", "fp"))
            .unwrap()
            .worker_id;
        assert_eq!(id, "prefill-1");
        let t0 = Instant::now();
        let hb = |addr: &str| {
            r.heartbeat(
                &v1::HeartbeatRequest {
                    worker_id: id.clone(),
                    grpc_addr: addr.into(),
                    ..Default::default()
                },
                t0,
            )
        };
        // The worker that held prefill-1 before the restart, at another address.
        assert!(matches!(hb("127.0.0.1:1"), Err(RouterError::UnknownWorker(_))));
        assert!(r.get("prefill-1").is_some_and(|w| w.grpc_addr == "127.0.0.1:2"));
        assert_eq!(hb("127.0.0.1:2").unwrap().state, WorkerState::Ready);
        // An old client that sends no address is still answered by id.
        assert_eq!(hb("").unwrap().state, WorkerState::Ready);
        r.deregister("prefill-1", "127.0.0.1:1");
        assert!(r.get("prefill-1").is_some());
        r.deregister("prefill-1", "127.0.0.1:2");
        assert!(r.get("prefill-1").is_none());
    }

    #[tokio::test]
    async fn ids_fingerprint_heartbeat_and_lease() {
        let r = registry();
        let a = r
            .register(&reg_req(v1::WorkerRole::Prefill, "127.0.0.1:1", "fp"))
            .unwrap();
        let b = r
            .register(&reg_req(v1::WorkerRole::Decode, "127.0.0.1:2", "fp"))
            .unwrap();
        let c = r
            .register(&reg_req(v1::WorkerRole::Prefill, "127.0.0.1:3", "fp"))
            .unwrap();
        assert_eq!(
            (
                a.worker_id.as_str(),
                b.worker_id.as_str(),
                c.worker_id.as_str()
            ),
            ("prefill-1", "decode-1", "prefill-2")
        );
        assert_eq!((a.lease_ms, a.heartbeat_ms), (3000, 1000));
        let err = r
            .register(&reg_req(v1::WorkerRole::Decode, "127.0.0.1:4", "other"))
            .unwrap_err();
        assert!(
            err.to_string().contains("other") && err.to_string().contains("fp"),
            "{err}"
        );
        assert_eq!(
            tonic::Status::from(err).code(),
            tonic::Code::FailedPrecondition
        );

        let t0 = Instant::now();
        let hb = |id: &str, at| {
            r.heartbeat(
                &v1::HeartbeatRequest {
                    worker_id: id.into(),
                    ..Default::default()
                },
                at,
            )
        };
        assert_eq!(
            hb("prefill-1", t0 + Duration::from_secs(2)).unwrap().state,
            WorkerState::Ready
        );
        assert!(matches!(hb("nope", t0), Err(RouterError::UnknownWorker(_))));
        // At t0+4.5 s: prefill-1 renewed at t0+2 s (alive), the other two expired.
        let mut dead = r.sweep(t0 + Duration::from_millis(4500));
        dead.sort();
        assert_eq!(dead, vec!["decode-1", "prefill-2"]);
        assert_eq!(r.ready(), Ready { prefill: 1, ..Ready::default() });
        // A dead worker's heartbeat is refused (NOT_FOUND) and the entry forgotten.
        assert!(matches!(
            hb("decode-1", t0),
            Err(RouterError::UnknownWorker(_))
        ));
        assert!(r.get("decode-1").is_none());
    }

    #[tokio::test]
    async fn drain_undrain_remove_and_guards() {
        let r = Arc::new(registry());
        r.register(&reg_req(v1::WorkerRole::Prefill, "127.0.0.1:1", "fp"))
            .unwrap();
        assert_eq!(
            r.drain("prefill-1").unwrap().state,
            v1::WorkerState::Draining as i32
        );
        assert_eq!(r.ready(), Ready::default());
        assert_eq!(
            r.undrain("prefill-1").unwrap().state,
            v1::WorkerState::Ready as i32
        );
        {
            let _g = InflightGuard::new(&r, "prefill-1", 100);
            let _h = InflightGuard::new(&r, "prefill-1", 20);
            let c = &r.prefill_candidates()[0];
            assert_eq!((c.inflight, c.outstanding_tokens), (2, 120));
        }
        let c = &r.prefill_candidates()[0];
        assert_eq!((c.inflight, c.outstanding_tokens), (0, 0));
        r.mark_dead("prefill-1", "test");
        assert_eq!(r.ready(), Ready::default());
        r.remove("prefill-1").unwrap();
        assert!(matches!(
            r.remove("prefill-1"),
            Err(RouterError::UnknownWorker(_))
        ));
    }
}
