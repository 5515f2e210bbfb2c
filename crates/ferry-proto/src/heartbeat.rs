//! The one loop that keeps a worker registered with a router, shared by the real worker
//! (`ferry_worker::cluster::registration`) and `ferry-testkit`'s mock workers: register (retrying with a
//! backoff), renew the lease by heartbeat, and register again whenever the router answers
//! NOT_FOUND (it restarted or dropped us). The lease is current once registered, and stops being
//! current when no heartbeat has been answered for a whole lease. What goes in each request and
//! what happens on each outcome is the [`Registrant`]'s.

use std::time::{Duration, Instant};

use crate::Bearer;
use crate::v1::registry_client::RegistryClient;
use crate::v1::{HeartbeatRequest, HeartbeatResponse, RegisterRequest, RegisterResponse};

/// A channel to a router whose every call carries the cluster secret.
pub type RegistryChannel = tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Bearer>;

/// Longest wait for one Register call (a router that accepts but does not answer).
pub const REGISTER_TIMEOUT: Duration = Duration::from_secs(5);

/// What happened on a worker's link to its router.
#[derive(Debug)]
pub enum LinkEvent<'a> {
    /// The router accepted a registration.
    Registered(&'a RegisterResponse),
    /// The router answered a heartbeat.
    Answered(&'a HeartbeatResponse),
    /// The router no longer knows the worker (NOT_FOUND): it registers again.
    Forgotten,
    /// A registration or heartbeat failed or was not answered in time (the router may be gone).
    Unanswered,
    /// Whether the lease is current, after a registration and after each heartbeat.
    Lease(bool),
}

/// The worker side of the loop: what each request carries, and what it makes of each event.
pub trait Registrant: Send {
    /// A Register request as of now (load, drain state).
    fn register_request(&mut self) -> RegisterRequest;
    /// A Heartbeat request for `worker_id` as of now.
    fn heartbeat_request(&mut self, worker_id: &str) -> HeartbeatRequest;
    fn observe(&mut self, event: LinkEvent<'_>);
    /// Waits until the next heartbeat is due, `every` after the last; false: stop heart-beating.
    fn next_beat(&mut self, every: Duration) -> impl Future<Output = bool> + Send;
}

/// Whether a lease last renewed at `last_ok` still holds at `now`.
pub fn lease_current(last_ok: Instant, now: Instant, lease: Duration) -> bool {
    now.saturating_duration_since(last_ok) < lease
}

/// How often the loop heartbeats at the most, whatever the router asks.
#[derive(Clone, Copy, Debug)]
pub struct HeartbeatFloor(pub Duration);

/// Keeps `who` registered through `client` until [`Registrant::next_beat`] says stop. `first`: a
/// registration already made (the loop starts heart-beating under it), or None to register first.
/// `router` names the router in the logs.
pub async fn keep_registered(
    mut client: RegistryClient<RegistryChannel>,
    router: &str,
    who: &mut impl Registrant,
    mut first: Option<RegisterResponse>,
    floor: HeartbeatFloor,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let resp = match first.take() {
            Some(r) => r,
            None => match tokio::time::timeout(REGISTER_TIMEOUT, client.register(who.register_request())).await {
                Ok(Ok(r)) => r.into_inner(),
                Ok(Err(status)) => {
                    who.observe(LinkEvent::Unanswered);
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
                    who.observe(LinkEvent::Unanswered);
                    tracing::debug!("registering with {router}: no answer within {REGISTER_TIMEOUT:?}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    continue;
                }
            },
        };
        backoff = Duration::from_millis(100);
        tracing::info!(worker_id = %resp.worker_id, %router, "registered");
        who.observe(LinkEvent::Registered(&resp));
        let mut last_ok = Instant::now();
        who.observe(LinkEvent::Lease(true));
        let every = Duration::from_millis(resp.heartbeat_ms as u64).max(floor.0);
        // A router too old to say its lease: assume three heartbeats.
        let lease = if resp.lease_ms > 0 { Duration::from_millis(resp.lease_ms as u64) } else { every * 3 };
        loop {
            if !who.next_beat(every).await {
                return;
            }
            // No call may outlast the lease: an unanswered heartbeat is a failed one.
            match tokio::time::timeout(lease, client.heartbeat(who.heartbeat_request(&resp.worker_id))).await {
                Ok(Ok(answer)) => {
                    who.observe(LinkEvent::Answered(answer.get_ref()));
                    last_ok = Instant::now();
                    who.observe(LinkEvent::Lease(true));
                }
                Ok(Err(status)) if status.code() == tonic::Code::NotFound => {
                    tracing::warn!("the router no longer knows {}: registering again", resp.worker_id);
                    who.observe(LinkEvent::Forgotten);
                    who.observe(LinkEvent::Lease(false));
                    break;
                }
                Ok(Err(status)) => {
                    who.observe(LinkEvent::Unanswered);
                    tracing::debug!("heartbeat to {router}: {}", status.message());
                }
                Err(_) => {
                    who.observe(LinkEvent::Unanswered);
                    tracing::debug!("heartbeat to {router}: no answer within the lease ({lease:?})");
                }
            }
            if !lease_current(last_ok, Instant::now(), lease) {
                who.observe(LinkEvent::Lease(false));
            }
        }
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
