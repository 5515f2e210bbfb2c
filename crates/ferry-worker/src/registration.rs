//! Keeping a worker registered with the router: register at start, renew the lease by heartbeat
//! (reporting load), and register again whenever the router does not know us (it restarted or
//! dropped us). Readiness turns true once registered. When the worker starts draining, the router
//! hears it at once (not at the next heartbeat), and once drained the worker deregisters.

use crate::kv::transport::Channels;
use crate::load::LoadGauge;
use ferry_proto::v1::registry_client::RegistryClient;
use ferry_proto::v1::{HeartbeatRequest, RegisterRequest, WorkerRef};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// The id the router gave at the latest registration (None before the first).
pub type WorkerId = Arc<Mutex<Option<String>>>;

fn set_id(id: &WorkerId, value: Option<String>) {
    *id.lock().unwrap_or_else(|p| p.into_inner()) = value;
}

pub async fn keep_registered(
    router: String,
    template: RegisterRequest,
    load: Arc<LoadGauge>,
    ready: watch::Sender<bool>,
    mut draining: watch::Receiver<bool>,
    id: WorkerId,
) {
    let channels = Channels::default();
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
        let resp = match client.register(req).await {
            Ok(r) => r.into_inner(),
            Err(status) => {
                if status.code() == tonic::Code::FailedPrecondition {
                    tracing::error!("the router refused registration: {}", status.message());
                } else {
                    tracing::debug!("registering with {router}: {}", status.message());
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        backoff = Duration::from_millis(100);
        tracing::info!(worker_id = %resp.worker_id, %router, "registered");
        set_id(&id, Some(resp.worker_id.clone()));
        let _ = ready.send(true);
        let every = Duration::from_millis(resp.heartbeat_ms.max(50) as u64);
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
            let hb = HeartbeatRequest { worker_id: resp.worker_id.clone(), load: Some(load.snapshot()), draining: *draining.borrow() };
            match client.heartbeat(hb).await {
                Ok(_) => {}
                Err(status) if status.code() == tonic::Code::NotFound => {
                    tracing::warn!("the router no longer knows {}: registering again", resp.worker_id);
                    set_id(&id, None);
                    let _ = ready.send(false);
                    break;
                }
                Err(status) => tracing::debug!("heartbeat to {router}: {}", status.message()),
            }
        }
    }
}

/// Leave the router's pool after a drain (best effort, bounded: the router may be gone).
pub async fn deregister(router: &str, id: &WorkerId) {
    let Some(worker_id) = id.lock().unwrap_or_else(|p| p.into_inner()).clone() else {
        return;
    };
    let Ok(channel) = Channels::default().get(router) else {
        return;
    };
    let mut client = RegistryClient::new(channel);
    let call = client.deregister(WorkerRef { worker_id: worker_id.clone() });
    match tokio::time::timeout(Duration::from_secs(2), call).await {
        Ok(Ok(_)) => tracing::info!(%worker_id, "deregistered from the router"),
        Ok(Err(s)) => tracing::warn!(%worker_id, "deregistering: {}", s.message()),
        Err(_) => tracing::warn!(%worker_id, "deregistering: the router did not answer within 2 s"),
    }
}
