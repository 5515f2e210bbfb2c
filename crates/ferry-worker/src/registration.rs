//! Keeping a worker registered with each of its routers: register at start, renew the lease by
//! heartbeat (reporting load), and register again whenever a router does not know us (it
//! restarted or dropped us). A router's link is ready once registered, not ready once no
//! heartbeat has been acknowledged for a whole lease (the router is gone or unreachable: it has
//! dropped us by now), and ready again when heartbeats are acknowledged or we register anew.
//! When the worker starts draining, every router hears it at once (not at the next heartbeat),
//! and once drained the worker deregisters from all of them.
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
use crate::kv::transport::Channels;
use crate::load::LoadGauge;
use ferry_proto::v1::registry_client::RegistryClient;
use ferry_proto::v1::{HeartbeatRequest, RegisterRequest, WorkerRef};
use ferry_proto::tls::ClientTls;
use ferry_proto::ClusterSecret;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// Longest wait for one Register call (a router that accepts but does not answer).
const REGISTER_TIMEOUT: Duration = Duration::from_secs(5);

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

/// Whether a lease last renewed at `last_ok` still holds at `now`.
pub fn lease_current(last_ok: Instant, now: Instant, lease: Duration) -> bool {
    now.saturating_duration_since(last_ok) < lease
}

/// Where one router link reports whether its lease is current.
pub trait LeaseFlag: Send + Sync {
    fn set(&self, current: bool);
}

/// One router, one flag (the worker's readiness when it has a single router).
impl LeaseFlag for watch::Sender<bool> {
    fn set(&self, current: bool) {
        self.send_replace(current);
    }
}

/// Set a link's flag, logging the change.
fn set_ready(ready: &dyn LeaseFlag, value: bool, router: &str, was: &mut Option<bool>) {
    ready.set(value);
    if *was != Some(value) {
        if value {
            tracing::info!(%router, "the lease with the router is current");
        } else {
            tracing::warn!(%router, "no lease with the router");
        }
    }
    *was = Some(value);
}

pub async fn keep_registered(link: RouterLink, template: RegisterRequest, load: Arc<LoadGauge>, ready: Arc<dyn LeaseFlag>, mut draining: watch::Receiver<bool>, id: WorkerId) {
    let mut was = None;
    let ready = ready.as_ref();
    let RouterLink { router, tls, cluster } = link;
    let channels = Channels::new(tls, cluster);
    let mut backoff = Duration::from_millis(100);
    loop {
        let mut client = match channels.get(&router) {
            Ok(c) => RegistryClient::new(c),
            Err(e) => {
                tracing::error!("router address: {e}");
                return;
            }
        };
        let req = RegisterRequest { load: Some(load.snapshot()), draining: *draining.borrow(), ..template.clone() };
        let resp = match tokio::time::timeout(REGISTER_TIMEOUT, client.register(req)).await {
            Ok(Ok(r)) => r.into_inner(),
            Ok(Err(status)) => {
                if matches!(status.code(), tonic::Code::FailedPrecondition | tonic::Code::Unauthenticated) {
                    tracing::error!("the router refused registration: {}", status.message());
                } else {
                    tracing::debug!("registering with {router}: {}", status.message());
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
            Err(_) => {
                tracing::debug!("registering with {router}: no answer within {REGISTER_TIMEOUT:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        backoff = Duration::from_millis(100);
        tracing::info!(worker_id = %resp.worker_id, %router, "registered");
        set_id(&id, Some(resp.worker_id.clone()));
        let mut last_ok = Instant::now();
        set_ready(ready, true, &router, &mut was);
        let every = Duration::from_millis(resp.heartbeat_ms.max(50) as u64);
        // A router too old to say its lease: assume three heartbeats.
        let lease = if resp.lease_ms > 0 { Duration::from_millis(resp.lease_ms as u64) } else { every * 3 };
        // A new registration starts clean at the router: it gets a snapshot first.
        let mut cursor = Cursor::registered();
        loop {
            // A drain starting is reported at once.
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                changed = draining.changed() => {
                    if changed.is_err() {
                        // The drain state is gone with its worker; keep heart-beating until aborted.
                        std::future::pending::<()>().await;
                    }
                }
            }
            // Unanswered, the same events go again next time (the cursor moves only on an answer).
            let (kv_events, upto) = match load.prefix_cache.load(std::sync::atomic::Ordering::Relaxed) {
                true => {
                    let o = load.cache_log.outgoing(&cursor);
                    (Some(o.events), o.upto)
                }
                false => (None, cursor.acked),
            };
            let hb = HeartbeatRequest { worker_id: resp.worker_id.clone(), load: Some(load.snapshot()), draining: *draining.borrow(), grpc_addr: template.grpc_addr.clone(), kv_events };
            // No call may outlast the lease: an unanswered heartbeat is a failed one.
            match tokio::time::timeout(lease, client.heartbeat(hb)).await {
                Ok(Ok(answer)) => {
                    cursor.acknowledged(upto, answer.get_ref().kv_resync);
                    last_ok = Instant::now();
                    set_ready(ready, true, &router, &mut was);
                }
                Ok(Err(status)) if status.code() == tonic::Code::NotFound => {
                    tracing::warn!("the router no longer knows {}: registering again", resp.worker_id);
                    set_id(&id, None);
                    set_ready(ready, false, &router, &mut was);
                    break;
                }
                Ok(Err(status)) => tracing::debug!("heartbeat to {router}: {}", status.message()),
                Err(_) => tracing::debug!("heartbeat to {router}: no answer within the lease ({lease:?})"),
            }
            if !lease_current(last_ok, Instant::now(), lease) {
                set_ready(ready, false, &router, &mut was);
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_holds_for_less_than_its_length() {
        let t = Instant::now();
        let lease = Duration::from_millis(3000);
        assert!(lease_current(t, t, lease));
        assert!(lease_current(t, t + Duration::from_millis(2999), lease));
        assert!(!lease_current(t, t + lease, lease));
        // A clock read before the renewal counts as current.
        assert!(lease_current(t + Duration::from_secs(1), t, lease));
    }
}
