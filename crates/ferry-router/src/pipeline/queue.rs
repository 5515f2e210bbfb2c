//! Backpressure instead of refusal: requests that no decode worker can admit yet wait here, in
//! arrival order, for room. Bounded in length (`--queue-max`; beyond it a request is refused at
//! once with RESOURCE_EXHAUSTED / HTTP 429 and a `Retry-After`) and in time (`--queue-timeout-ms`;
//! a request that waited that long is refused the same way).
//!
//! FIFO: a waiter holds a [`Place`]; only the head of the line (the holder of the fair
//! `tokio::sync::Mutex`, which grants in request order) tries admission again, woken by
//! [`AdmissionQueue::room`] (a request finished, a worker registered or reported free blocks) or
//! after a short tick. A request that arrives while others wait joins the line behind them
//! rather than overtaking.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::{Duration, Instant};

use tokio::sync::{Mutex, Notify, OwnedMutexGuard};

use crate::RouterError;

/// How long the head of the line waits for a wake-up before it looks again anyway (a worker's
/// free blocks arrive with its heartbeat, which wakes nobody).
const TICK: Duration = Duration::from_millis(100);

pub struct AdmissionQueue {
    max: usize,
    timeout: Duration,
    /// Requests in the line (the head included).
    depth: AtomicUsize,
    head: Arc<Mutex<()>>,
    /// Shared with the registry, which wakes it when room may have appeared.
    room: Arc<Notify>,
}

/// One request's place in the line; leaving it (drop) frees the place.
pub struct Place {
    queue: Arc<AdmissionQueue>,
    entered: Instant,
    head: Option<OwnedMutexGuard<()>>,
}

impl AdmissionQueue {
    pub fn new(max: usize, timeout: Duration, room: Arc<Notify>) -> Arc<AdmissionQueue> {
        Arc::new(AdmissionQueue {
            max,
            timeout,
            depth: AtomicUsize::new(0),
            head: Arc::new(Mutex::new(())),
            room,
        })
    }

    /// Requests waiting now.
    pub fn depth(&self) -> usize {
        self.depth.load(SeqCst)
    }

    /// Something may have made room (a request ended, a worker came): the head looks again.
    pub fn room(&self) {
        self.room.notify_waiters();
    }

    /// Joins the line, or refuses at once when it is full.
    pub fn enter(self: &Arc<Self>) -> Result<Place, RouterError> {
        let n = self.depth.fetch_add(1, SeqCst);
        if n >= self.max {
            self.depth.fetch_sub(1, SeqCst);
            metrics::counter!(crate::metrics::names::QUEUE_REJECTED, "reason" => "full").increment(1);
            return Err(RouterError::QueueFull {
                depth: n,
                max: self.max,
                retry_after_s: self.retry_after_s(),
            });
        }
        metrics::gauge!(crate::metrics::names::QUEUE_DEPTH).set((n + 1) as f64);
        Ok(Place {
            queue: self.clone(),
            entered: Instant::now(),
            head: None,
        })
    }

    /// A hint for clients: about how long the line takes to move (at least a second).
    fn retry_after_s(&self) -> u32 {
        (self.timeout.as_secs() / 4).clamp(1, 30) as u32
    }
}

impl Place {
    /// How long this request has held its place.
    pub fn waited(&self) -> Duration {
        self.entered.elapsed()
    }

    /// Waits until this request is at the head of the line and there may be room (woken, or a
    /// tick passed). Fails when it has waited the queue's timeout in all.
    pub async fn wait_turn(&mut self) -> Result<(), RouterError> {
        let q = self.queue.clone();
        let deadline = self.entered + q.timeout;
        let timed_out = || {
            metrics::counter!(crate::metrics::names::QUEUE_REJECTED, "reason" => "timeout").increment(1);
            RouterError::QueueTimeout {
                waited_ms: self.entered.elapsed().as_millis() as u64,
                retry_after_s: q.retry_after_s(),
            }
        };
        if self.head.is_none() {
            match tokio::time::timeout_at(deadline.into(), q.head.clone().lock_owned()).await {
                Ok(g) => self.head = Some(g),
                Err(_) => return Err(timed_out()),
            }
            // The head tries at once: the previous head may have left because it got room.
            return Ok(());
        }
        let wake = q.room.notified();
        let tick = Instant::now() + TICK;
        if tick >= deadline {
            tokio::time::sleep_until(deadline.into()).await;
            return Err(timed_out());
        }
        tokio::select! {
            _ = wake => {}
            _ = tokio::time::sleep_until(tick.into()) => {}
        }
        Ok(())
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.head = None;
        let n = self.queue.depth.fetch_sub(1, SeqCst).saturating_sub(1);
        metrics::gauge!(crate::metrics::names::QUEUE_DEPTH).set(n as f64);
        // The next in line may get the room this one did not take.
        self.queue.room();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(max: usize, timeout_ms: u64) -> Arc<AdmissionQueue> {
        AdmissionQueue::new(max, Duration::from_millis(timeout_ms), Arc::new(Notify::new()))
    }

    #[tokio::test]
    async fn a_full_line_refuses_at_once_with_a_retry_hint() {
        let q = queue(2, 10_000);
        let a = q.enter().expect("first place");
        let _b = q.enter().expect("second place");
        match q.enter() {
            Err(e @ RouterError::QueueFull { depth: 2, max: 2, .. }) => {
                assert!(e.retry_after_s().is_some_and(|s| s >= 1), "{e}");
                assert_eq!(e.grpc_code(), tonic::Code::ResourceExhausted);
                assert_eq!(e.http_status(), axum::http::StatusCode::TOO_MANY_REQUESTS);
            }
            other => panic!("expected QueueFull, got {:?}", other.err()),
        }
        drop(a);
        assert_eq!(q.depth(), 1);
        assert!(q.enter().is_ok(), "a place freed by drop is taken again");
    }

    #[tokio::test]
    async fn waiters_take_turns_in_arrival_order() {
        let q = queue(8, 10_000);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        // The first holds the head of the line until told to leave.
        let mut first = q.enter().expect("place");
        first.wait_turn().await.expect("head");
        let mut tasks = Vec::new();
        for i in 0..4 {
            let mut p = q.enter().expect("place");
            let tx = tx.clone();
            tasks.push(tokio::spawn(async move {
                p.wait_turn().await.expect("turn");
                tx.send(i).expect("send");
                // Leaving the line hands the head to the next.
                drop(p);
            }));
            // Each waiter is queued on the head lock before the next one enters.
            tokio::task::yield_now().await;
            tokio::task::yield_now().await;
        }
        assert_eq!(q.depth(), 5);
        drop(first);
        for t in tasks {
            t.await.expect("task");
        }
        let order: Vec<i32> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
        assert_eq!(order, vec![0, 1, 2, 3]);
        assert_eq!(q.depth(), 0);
    }

    #[tokio::test]
    async fn the_head_times_out_and_is_woken_by_room() {
        let q = queue(4, 300);
        let mut p = q.enter().expect("place");
        p.wait_turn().await.expect("head at once");
        // Woken by `room` well before the tick would have.
        let waker = q.clone();
        let t = Instant::now();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            waker.room();
        });
        p.wait_turn().await.expect("woken");
        assert!(t.elapsed() < Duration::from_millis(TICK.as_millis() as u64), "{:?}", t.elapsed());
        // Past the timeout: refused with the time it waited.
        let err = loop {
            if let Err(e) = p.wait_turn().await {
                break e;
            }
        };
        assert!(matches!(err, RouterError::QueueTimeout { waited_ms, .. } if waited_ms >= 300), "{err}");
    }
}
