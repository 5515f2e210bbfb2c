//! Graceful drain. On SIGTERM (or `ferry pool drain` followed by a stop) a worker first tells its
//! routers at once ([`Drain::announce`]; nothing more is routed to it), keeps taking what they
//! dispatched before they heard, then stops taking new work and lets every request it holds run
//! to its end ([`Drain::drain`]) — for a prefill worker that means until the decode worker has
//! acknowledged the KV it was sent — and only then deregisters and exits. Kubernetes' scale-down
//! and rolling updates go through the same path, so they lose no in-flight request and cost no
//! retry.
//!
//! Every unit of work holds a [`Work`] guard from [`Drain::begin`]; the count can only fall back
//! to zero through `Drop`, so an early return, an error or a cancelled request cannot wedge a
//! drain. A refusal while draining is UNAVAILABLE tagged `ferry-error: draining`
//! ([`ferry_core::failure::WorkerFault::Draining`]): try another worker, this one is not dead.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Notify};

use crate::error::WorkerError;

/// A worker's drain state: whether it still takes work, and the work it holds.
pub struct Drain {
    name: String,
    draining: AtomicBool,
    inflight: AtomicUsize,
    idle: Notify,
    /// Turns true when the drain is announced (the registration tasks report it to the routers).
    signal: watch::Sender<bool>,
}

/// One request held by the worker; dropping it may complete a drain.
pub struct Work(Arc<Drain>);

impl Drop for Work {
    fn drop(&mut self) {
        if self.0.inflight.fetch_sub(1, SeqCst) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// How a drain ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainOutcome {
    /// Every request finished.
    Idle,
    /// The timeout passed with this many requests still held.
    TimedOut { left: usize },
}

impl Drain {
    pub fn new(name: impl Into<String>) -> Arc<Drain> {
        Arc::new(Drain {
            name: name.into(),
            draining: AtomicBool::new(false),
            inflight: AtomicUsize::new(0),
            idle: Notify::new(),
            signal: watch::channel(false).0,
        })
    }

    /// Take one unit of work, or refuse it (retryable elsewhere) when draining.
    pub fn begin(self: &Arc<Self>) -> Result<Work, WorkerError> {
        // Count first, then check: a drain that starts in between sees this work and waits.
        self.inflight.fetch_add(1, SeqCst);
        let work = Work(self.clone());
        if self.draining.load(SeqCst) {
            return Err(WorkerError::Draining { worker: self.name.clone() });
        }
        Ok(work)
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(SeqCst)
    }

    pub fn inflight(&self) -> usize {
        self.inflight.load(SeqCst)
    }

    /// Follows the drain flag (for the registration task).
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.signal.subscribe()
    }

    /// Tell the routers (through the registration tasks) and the readiness probe that this
    /// worker is leaving; work is still taken until [`Drain::drain`].
    pub fn announce(&self) {
        self.signal.send_replace(true);
    }

    /// Stop taking work and wait until everything held has finished, at most `timeout`
    /// (announcing the drain first if that was not done).
    pub async fn drain(&self, timeout: Duration) -> DrainOutcome {
        self.announce();
        self.draining.store(true, SeqCst);
        let idle = async {
            loop {
                let notified = self.idle.notified();
                tokio::pin!(notified);
                // Register before checking, so a wake-up between the two is not lost.
                notified.as_mut().enable();
                if self.inflight.load(SeqCst) == 0 {
                    return;
                }
                notified.await;
            }
        };
        match tokio::time::timeout(timeout, idle).await {
            Ok(()) => DrainOutcome::Idle,
            Err(_) => DrainOutcome::TimedOut { left: self.inflight() },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn drain_waits_for_work_and_refuses_new() {
        let d = Drain::new("w");
        let a = d.begin().expect("open");
        let b = d.begin().expect("open");
        let d2 = d.clone();
        let waiter = tokio::spawn(async move { d2.drain(Duration::from_secs(5)).await });
        // The drain flag is set promptly; new work is refused with the draining error.
        while !d.is_draining() {
            tokio::task::yield_now().await;
        }
        match d.begin() {
            Err(WorkerError::Draining { worker }) => assert_eq!(worker, "w"),
            Err(e) => panic!("wrong refusal: {e}"),
            Ok(_) => panic!("accepted work while draining"),
        }
        assert_eq!(d.inflight(), 2, "a refused begin leaves no count behind");
        drop(a);
        assert!(!waiter.is_finished());
        drop(b);
        assert_eq!(waiter.await.expect("join"), DrainOutcome::Idle);
    }

    #[tokio::test]
    async fn drain_times_out_with_work_left() {
        let d = Drain::new("w");
        let _held = d.begin().expect("open");
        assert_eq!(d.drain(Duration::from_millis(30)).await, DrainOutcome::TimedOut { left: 1 });
    }

    #[tokio::test]
    async fn an_announced_drain_still_takes_work_until_it_drains() {
        let d = Drain::new("w");
        let mut rx = d.subscribe();
        d.announce();
        assert!(*rx.borrow_and_update(), "the routers hear of the drain");
        assert!(!d.is_draining());
        let late = d.begin().expect("a request dispatched before the routers heard is taken");
        let d2 = d.clone();
        let waiter = tokio::spawn(async move { d2.drain(Duration::from_secs(5)).await });
        while !d.is_draining() {
            tokio::task::yield_now().await;
        }
        assert!(d.begin().is_err(), "refused once draining");
        drop(late);
        assert_eq!(waiter.await.expect("join"), DrainOutcome::Idle);
    }

    #[tokio::test]
    async fn an_idle_worker_drains_at_once() {
        let d = Drain::new("w");
        let mut rx = d.subscribe();
        assert_eq!(d.drain(Duration::from_secs(5)).await, DrainOutcome::Idle);
        assert!(*rx.borrow_and_update());
    }
}
