//! Keeping a worker registered with the router: register at start, renew the lease by heartbeat
//! (reporting load), and register again whenever the router does not know us (it restarted or
//! dropped us). Readiness turns true once registered.

use crate::kv::transport::Channels;
use crate::load::LoadGauge;
use ferry_proto::v1::registry_client::RegistryClient;
use ferry_proto::v1::{HeartbeatRequest, RegisterRequest};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

pub async fn keep_registered(router: String, template: RegisterRequest, load: Arc<LoadGauge>, ready: watch::Sender<bool>) {
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
        let req = RegisterRequest { load: Some(load.snapshot()), ..template.clone() };
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
        let _ = ready.send(true);
        let every = Duration::from_millis(resp.heartbeat_ms.max(50) as u64);
        loop {
            tokio::time::sleep(every).await;
            let hb = HeartbeatRequest { worker_id: resp.worker_id.clone(), load: Some(load.snapshot()) };
            match client.heartbeat(hb).await {
                Ok(_) => {}
                Err(status) if status.code() == tonic::Code::NotFound => {
                    tracing::warn!("the router no longer knows {}: registering again", resp.worker_id);
                    let _ = ready.send(false);
                    break;
                }
                Err(status) => tracing::debug!("heartbeat to {router}: {}", status.message()),
            }
        }
    }
}
