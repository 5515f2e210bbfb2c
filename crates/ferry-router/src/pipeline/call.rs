//! Every call the router makes to a worker for a request is watched: it ends when it answers,
//! when the client goes away, when a worker it involves is marked dead (a lease ran out, another
//! call found it gone), or at its deadline. Nothing waits on a dead peer.

use std::time::{Duration, Instant};

use ferry_core::failure::{FAULT_KEY, WorkerFault};
use tonic::Status;
use tonic::metadata::MetadataValue;

use crate::workers::registry::Worker;

use crate::pipeline::request::Tx;

/// Why a watched call ended without its answer.
#[derive(Debug)]
pub enum Interrupt {
    /// The client went away: the request is cancelled (dropping the call cancels it remotely).
    ClientGone,
    /// The call failed, or was cut short (as a status the classifier reads, with no worker tag:
    /// a dead worker and a deadline both read as the transport's failure).
    Failed(Status),
}

/// Awaits `fut` for at most `deadline`, unless the client goes away or one of `workers` (the
/// callee, then its peer for this request) is marked dead first; the time spent is added to
/// `waited`. A dead peer's status is tagged [`WorkerFault::Peer`] so the blame lands on it.
pub async fn watched<T>(
    tx: &Tx,
    waited: &mut Duration,
    workers: &[&Worker],
    deadline: Duration,
    what: &str,
    fut: impl Future<Output = Result<T, Status>>,
) -> Result<T, Interrupt> {
    let t = Instant::now();
    let first = workers.first().map(|w| (w.id.clone(), w.gone()));
    let second = workers.get(1).map(|w| (w.id.clone(), w.gone()));
    let gone = async move {
        let wait = |g: Option<(String, _)>| async move {
            match g {
                Some((id, f)) => {
                    f.await;
                    id
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            id = wait(first) => (id, false),
            id = wait(second) => (id, true),
        }
    };
    let r = tokio::select! {
        r = fut => r.map_err(Interrupt::Failed),
        _ = tx.closed() => Err(Interrupt::ClientGone),
        (id, peer) = gone => {
            let mut s = Status::unavailable(format!(
                "worker {id} was marked dead during {what} (its lease ran out or another call found it gone)"
            ));
            if peer {
                s.metadata_mut().insert(FAULT_KEY, MetadataValue::from_static(WorkerFault::Peer.as_str()));
            }
            Err(Interrupt::Failed(s))
        }
        _ = tokio::time::sleep(deadline) => Err(Interrupt::Failed(Status::deadline_exceeded(format!(
            "no answer to {what} within {} ms", deadline.as_millis()
        )))),
    };
    *waited += t.elapsed();
    r
}

/// Whether something still accepts TCP connections at `addr` (a quick liveness probe). A frozen
/// process still completes handshakes (the kernel does), so `true` proves little: its lease or
/// the channel's keepalive settles it within seconds.
pub async fn reachable(addr: &str) -> bool {
    let addr = addr.trim_start_matches("http://").trim_start_matches("https://");
    matches!(
        tokio::time::timeout(Duration::from_millis(300), tokio::net::TcpStream::connect(addr)).await,
        Ok(Ok(_))
    )
}
