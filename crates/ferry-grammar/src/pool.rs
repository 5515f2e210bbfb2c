//! Where grammars compile: a few dedicated threads with large stacks, never the async runtime.
//!
//! llguidance compiles recursively (a long chain of Lark rules recursed past a runtime thread's
//! 2 MiB stack and aborted the router, issue 32), and a compile or a first mask can take CPU
//! time that would starve a runtime's other requests. So each compile runs on a rayon pool of
//! `threads` threads with `stack_bytes` stacks; at most `threads + queue` compiles are admitted
//! at once, and one that waited longer than `queue_wait` for a thread is refused as
//! [`GrammarError::Busy`] (retryable: the grammar may be fine, the compiler is full). A compile
//! that takes longer than `compile_budget` is refused as [`GrammarError::Timeout`] (final: it
//! would take as long again). A panic inside becomes [`GrammarError::Panicked`].

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::{GrammarError, GrammarKind};

/// The compile pool's size and time limits. [`PoolConfig::default`] is what `ferry` serves with.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolConfig {
    /// Threads compiling at once.
    pub threads: usize,
    /// Compiles that may wait for a thread beyond those running.
    pub queue: usize,
    /// Each thread's stack.
    pub stack_bytes: usize,
    /// The longest a compile may wait for a thread.
    pub queue_wait: Duration,
    /// The longest a compile (and its first mask) may take.
    pub compile_budget: Duration,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            threads: 2,
            queue: 32,
            stack_bytes: 64 << 20,
            queue_wait: Duration::from_secs(2),
            compile_budget: Duration::from_secs(2),
        }
    }
}

/// The threads grammars compile on, and the count of compiles admitted.
pub struct CompilePool {
    pool: rayon::ThreadPool,
    cfg: PoolConfig,
    admitted: Arc<AtomicUsize>,
}

impl std::fmt::Debug for CompilePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompilePool").field("cfg", &self.cfg).field("admitted", &self.admitted.load(Ordering::Relaxed)).finish()
    }
}

/// One admitted compile; dropping it (the job ran, or never will) frees its place.
struct Admission(Arc<AtomicUsize>);

impl Drop for Admission {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl CompilePool {
    pub fn new(cfg: PoolConfig) -> Result<Self, GrammarError> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(cfg.threads.max(1))
            .stack_size(cfg.stack_bytes)
            .thread_name(|i| format!("ferry-grammar-{i}"))
            .build()
            .map_err(|e| GrammarError::Threads(e.to_string()))?;
        Ok(Self { pool, cfg, admitted: Arc::new(AtomicUsize::new(0)) })
    }

    pub fn config(&self) -> &PoolConfig {
        &self.cfg
    }

    /// Runs `job` (a compile of a `kind` grammar) on the pool and waits for it. `slack`: extra
    /// time the first compile may take beyond the budget (building the token trie).
    pub async fn run<T: Send + 'static>(
        &self,
        kind: GrammarKind,
        slack: Duration,
        job: impl FnOnce() -> Result<T, GrammarError> + Send + 'static,
    ) -> Result<T, GrammarError> {
        let cap = self.cfg.threads.max(1) + self.cfg.queue;
        let taken = self.admitted.fetch_add(1, Ordering::AcqRel);
        let admission = Admission(self.admitted.clone());
        if taken >= cap {
            return Err(GrammarError::Busy { waited_ms: 0 });
        }
        let (tx, rx) = oneshot::channel();
        let (queue_wait, budget) = (self.cfg.queue_wait, self.cfg.compile_budget + slack);
        let enqueued = Instant::now();
        self.pool.spawn(move || {
            let _admission = admission;
            let waited = enqueued.elapsed();
            if waited > queue_wait {
                let _ = tx.send(Err(GrammarError::Busy { waited_ms: waited.as_millis() as u64 }));
                return;
            }
            if tx.is_closed() {
                return; // the request is gone: nobody waits for this compile
            }
            let t0 = Instant::now();
            let r = std::panic::catch_unwind(AssertUnwindSafe(job)).unwrap_or(Err(GrammarError::Panicked { kind }));
            let r = if t0.elapsed() > budget { Err(GrammarError::Timeout { kind, budget_ms: budget.as_millis() as u64 }) } else { r };
            let _ = tx.send(r);
        });
        match tokio::time::timeout(queue_wait + budget, rx).await {
            Ok(Ok(r)) => r,
            // The job ended without answering (it cannot, short of an abort).
            Ok(Err(_)) => Err(GrammarError::Panicked { kind }),
            // Still compiling past its budget: the client is answered now; the thread finishes
            // (llguidance's fuel bounds it) and its result is dropped.
            Err(_) => Err(GrammarError::Timeout { kind, budget_ms: budget.as_millis() as u64 }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(threads: usize, queue: usize, wait_ms: u64, budget_ms: u64) -> Arc<CompilePool> {
        let cfg = PoolConfig {
            threads,
            queue,
            stack_bytes: 8 << 20,
            queue_wait: Duration::from_millis(wait_ms),
            compile_budget: Duration::from_millis(budget_ms),
        };
        Arc::new(CompilePool::new(cfg).unwrap())
    }

    #[tokio::test]
    async fn jobs_run_and_panics_become_errors() {
        let p = pool(1, 4, 1000, 1000);
        assert_eq!(p.run(GrammarKind::Regex, Duration::ZERO, || Ok(7)).await.unwrap(), 7);
        let r: Result<(), _> = p.run(GrammarKind::Lark, Duration::ZERO, || panic!("boom")).await;
        assert!(matches!(r, Err(GrammarError::Panicked { kind: GrammarKind::Lark })), "{r:?}");
        // The pool still works after a panic.
        assert_eq!(p.run(GrammarKind::Regex, Duration::ZERO, || Ok(8)).await.unwrap(), 8);
    }

    #[tokio::test]
    async fn a_slow_compile_is_refused_at_its_budget() {
        let p = pool(1, 4, 1000, 50);
        let t0 = Instant::now();
        let r = p.run(GrammarKind::Lark, Duration::ZERO, || {
            std::thread::sleep(Duration::from_millis(300));
            Ok(())
        });
        assert!(matches!(r.await, Err(GrammarError::Timeout { .. })));
        assert!(t0.elapsed() < Duration::from_millis(1200));
    }

    #[tokio::test]
    async fn a_full_pool_refuses_with_busy() {
        let p = pool(1, 0, 100, 5000);
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let busy = {
            let p = p.clone();
            tokio::spawn(async move {
                p.run(GrammarKind::Lark, Duration::ZERO, move || {
                    let _ = go_rx.recv_timeout(Duration::from_secs(5));
                    Ok(())
                })
                .await
            })
        };
        // Wait until the first job holds the only place.
        while p.admitted.load(Ordering::Acquire) == 0 {
            tokio::task::yield_now().await;
        }
        let r = p.run(GrammarKind::Regex, Duration::ZERO, || Ok(())).await;
        assert!(matches!(r, Err(GrammarError::Busy { waited_ms: 0 })), "{r:?}");
        go_tx.send(()).unwrap();
        busy.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_compile_that_waited_too_long_for_a_thread_is_busy() {
        let p = pool(1, 4, 50, 5000);
        let first = {
            let p = p.clone();
            tokio::spawn(async move {
                p.run(GrammarKind::Lark, Duration::ZERO, || {
                    std::thread::sleep(Duration::from_millis(300));
                    Ok(())
                })
                .await
            })
        };
        while p.admitted.load(Ordering::Acquire) == 0 {
            tokio::task::yield_now().await;
        }
        let r = p.run(GrammarKind::Regex, Duration::ZERO, || Ok(())).await;
        assert!(matches!(r, Err(GrammarError::Busy { waited_ms }) if waited_ms >= 50), "{r:?}");
        first.await.unwrap().unwrap();
    }
}
