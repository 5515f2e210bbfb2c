//! Keeping a worker registered with each of its routers: register at start, renew the lease by
//! heartbeat (reporting load), and register again whenever a router does not know us (it
//! restarted or dropped us). A router's link is ready once registered, not ready once no
//! heartbeat has been acknowledged for a whole lease (the router is gone or unreachable: it has
//! dropped us by now), and ready again when heartbeats are acknowledged or we register anew.
//! When the worker starts draining, every router hears it at once (not at the next heartbeat),
//! each link reports when its router has answered a message that said so
//! ([`LeaseFlag::drain_heard`]), and once drained the worker deregisters from all of them.
//!
//! Several routers serve the same pools ([`routers`]): the worker is given a list, and each
//! entry that is a DNS name resolving to several addresses (a headless Service) counts as one
//! router per address, re-resolved periodically. Each router gives the worker its own id; one
//! router failing does not touch the others' links.
//!
//! With the prefix cache on, each heartbeat also carries the cache's events since the last one
//! that router answered, or a snapshot after a registration and whenever the router asks
//! ([`crate::cache_log`]); each link keeps its own cursor.

use crate::cache_log::Cursor;
use crate::kv::send::Channels;
use crate::load::LoadGauge;
use ferry_proto::heartbeat::{self, HeartbeatFloor, LinkEvent, Registrant};
use ferry_proto::v1::registry_client::RegistryClient;
use ferry_proto::v1::{HeartbeatRequest, RegisterRequest, WorkerRef};
use ferry_proto::tls::ClientTls;
use ferry_proto::ClusterSecret;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// A worker heartbeats at most this often, whatever the router asks.
const HEARTBEAT_FLOOR: HeartbeatFloor = HeartbeatFloor(Duration::from_millis(50));

/// How a worker reaches its router: the address, TLS, the cluster secret.
#[derive(Clone)]
pub struct RouterLink {
    pub router: String,
    pub tls: Option<ClientTls>,
    pub cluster: ClusterSecret,
}

/// The id the router gave at the latest registration (None before the first).
pub type WorkerId = Arc<Mutex<Option<String>>>;

fn set_id(id: &WorkerId, value: Option<String>) {
    *id.lock().unwrap_or_else(|p| p.into_inner()) = value;
}

/// Where one router link reports whether its lease is current.
pub trait LeaseFlag: Send + Sync {
    fn set(&self, current: bool);
    /// The router answered a registration or heartbeat that said the worker is draining (it
    /// routes nothing new here), or could not be reached with one (it is gone, or cannot route
    /// here either).
    fn drain_heard(&self) {}
}

/// One router, one flag (the worker's readiness when it has a single router).
impl LeaseFlag for watch::Sender<bool> {
    fn set(&self, current: bool) {
        self.send_replace(current);
    }
}

/// This worker as one router sees it: its load, drain state and cache events, and where the
/// link's id and lease are reported.
struct Worker {
    router: String,
    template: RegisterRequest,
    load: Arc<LoadGauge>,
    ready: Arc<dyn LeaseFlag>,
    draining: watch::Receiver<bool>,
    id: WorkerId,
    /// The lease state last reported (for logging its changes).
    was: Option<bool>,
    /// Cache events the router has acknowledged; a new registration starts clean (a snapshot first).
    cursor: Cursor,
    /// The last event in the heartbeat in flight.
    upto: u64,
    /// Whether the registration or heartbeat in flight says the worker is draining.
    says_draining: bool,
}

impl Worker {
    fn draining_now(&mut self) -> bool {
        self.says_draining = *self.draining.borrow();
        self.says_draining
    }

    /// The message in flight was answered, or failed: if it said the worker drains, the router
    /// has heard it (or cannot route here either).
    fn call_settled(&self) {
        if self.says_draining {
            self.ready.drain_heard();
        }
    }
}

impl Registrant for Worker {
    fn register_request(&mut self) -> RegisterRequest {
        RegisterRequest { load: Some(self.load.snapshot()), draining: self.draining_now(), ..self.template.clone() }
    }

    fn heartbeat_request(&mut self, worker_id: &str) -> HeartbeatRequest {
        // Unanswered, the same events go again next time (the cursor moves only on an answer).
        let kv_events = match self.load.prefix_cache.load(std::sync::atomic::Ordering::Relaxed) {
            true => {
                let o = self.load.cache_log.outgoing(&self.cursor);
                self.upto = o.upto;
                Some(o.events)
            }
            false => {
                self.upto = self.cursor.acked;
                None
            }
        };
        HeartbeatRequest { worker_id: worker_id.to_string(), load: Some(self.load.snapshot()), draining: self.draining_now(), grpc_addr: self.template.grpc_addr.clone(), kv_events }
    }

    fn observe(&mut self, event: LinkEvent<'_>) {
        match event {
            LinkEvent::Registered(resp) => {
                set_id(&self.id, Some(resp.worker_id.clone()));
                self.cursor = Cursor::registered();
                self.call_settled();
            }
            LinkEvent::Answered(answer) => {
                self.cursor.acknowledged(self.upto, answer.kv_resync);
                self.call_settled();
            }
            LinkEvent::Forgotten => set_id(&self.id, None),
            LinkEvent::Unanswered => self.call_settled(),
            LinkEvent::Lease(current) => {
                self.ready.set(current);
                if self.was != Some(current) {
                    if current {
                        tracing::info!(router = %self.router, "the lease with the router is current");
                    } else {
                        tracing::warn!(router = %self.router, "no lease with the router");
                    }
                }
                self.was = Some(current);
            }
        }
    }

    async fn next_beat(&mut self, every: Duration) -> bool {
        // A drain starting is reported at once.
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            changed = self.draining.changed() => {
                if changed.is_err() {
                    // The drain state is gone with its worker; keep heart-beating until aborted.
                    std::future::pending::<()>().await;
                }
            }
        }
        true
    }
}

/// Registers with `link`'s router and keeps the registration (the loop of
/// [`ferry_proto::heartbeat`]), reporting the lease to `ready` and the id to `id`.
pub async fn keep_registered(link: RouterLink, template: RegisterRequest, load: Arc<LoadGauge>, ready: Arc<dyn LeaseFlag>, draining: watch::Receiver<bool>, id: WorkerId) {
    let RouterLink { router, tls, cluster } = link;
    let client = match Channels::new(tls, cluster).get(&router) {
        Ok(c) => RegistryClient::new(c),
        Err(e) => {
            tracing::error!("router address: {e}");
            return;
        }
    };
    let mut worker = Worker { router: router.clone(), template, load, ready, draining, id, was: None, cursor: Cursor::registered(), upto: 0, says_draining: false };
    heartbeat::keep_registered(client, &router, &mut worker, None, HEARTBEAT_FLOOR).await;
}

/// Leave the router's pool after a drain (best effort, bounded: the router may be gone). `addr`
/// is the worker's gRPC address, as it registered.
pub async fn deregister(link: RouterLink, id: &WorkerId, addr: String) {
    let RouterLink { router, tls, cluster } = link;
    let router = router.as_str();
    let Some(worker_id) = id.lock().unwrap_or_else(|p| p.into_inner()).clone() else {
        return;
    };
    let Ok(channel) = Channels::new(tls, cluster).get(router) else {
        return;
    };
    let mut client = RegistryClient::new(channel);
    let call = client.deregister(WorkerRef { worker_id: worker_id.clone(), grpc_addr: addr });
    match tokio::time::timeout(Duration::from_secs(2), call).await {
        Ok(Ok(_)) => tracing::info!(%worker_id, %router, "deregistered from the router"),
        Ok(Err(s)) => tracing::warn!(%worker_id, "deregistering: {}", s.message()),
        Err(_) => tracing::warn!(%worker_id, "deregistering: the router did not answer within 2 s"),
    }
}
