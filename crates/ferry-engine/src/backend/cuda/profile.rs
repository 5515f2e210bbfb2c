//! Where a step's time goes on the GPU (`FERRY_CUDA_PROFILE=1`): each backend operation records a
//! timing event on the stream before and after its work, and each step (one [`Backend::run`]) is
//! resolved when it ends: per kind of step (decode batches by size, prefill), the GPU time of
//! each operation, the GPU's span from the step's start to its last operation's end, and the
//! host's wall time of the step. The span less the operations' sum is the time the GPU waited between them
//! (launch gaps, host work, uploads). Names that begin with `·` are parts of an operation (a
//! matmul's cast, attention's split path), listed but not added to the sum. Printed to stderr when
//! the backend is dropped. Off by default: events cost a few microseconds per operation.
//!
//! [`Backend::run`]: crate::backend::Backend::run

#[cfg(feature = "cuda")]
use cudarc::driver::sys::CUevent_flags;
#[cfg(feature = "cuda")]
use cudarc::driver::{CudaEvent, CudaStream};
use std::collections::BTreeMap;
#[cfg(feature = "cuda")]
use std::sync::Mutex;
use std::time::Duration;
#[cfg(feature = "cuda")]
use std::time::Instant;

/// Totals of one kind of step.
#[derive(Default)]
struct Kind {
    steps: u64,
    host: Duration,
    span_ms: f64,
    /// Per operation: GPU milliseconds and calls.
    ops: BTreeMap<&'static str, (f64, u64)>,
}

/// The steps resolved so far, by kind (plain numbers: the part a CPU test checks).
#[derive(Default)]
pub(crate) struct Totals {
    kinds: BTreeMap<String, Kind>,
    /// Events that failed to record or resolve (the report says so rather than mislead).
    lost: u64,
}

impl Totals {
    /// One step of kind `name`: its host wall time, its GPU span (first event to last) and each
    /// operation's GPU milliseconds, in order.
    pub(crate) fn add_step(&mut self, name: String, host: Duration, span_ms: f64, ops: &[(&'static str, f64)]) {
        let k = self.kinds.entry(name).or_default();
        k.steps += 1;
        k.host += host;
        k.span_ms += span_ms;
        for &(op, ms) in ops {
            let e = k.ops.entry(op).or_default();
            e.0 += ms;
            e.1 += 1;
        }
    }

    /// The report: per kind of step, per step on average, operations by time.
    pub(crate) fn report(&self) -> String {
        let mut out = String::from("cuda profile (FERRY_CUDA_PROFILE=1): per step, averaged over the steps of each kind\n");
        for (name, k) in &self.kinds {
            let n = k.steps.max(1) as f64;
            let busy: f64 = k.ops.iter().filter(|(op, _)| !op.starts_with('·')).map(|(_, (ms, _))| ms).sum::<f64>() / n;
            let span = k.span_ms / n;
            out += &format!(
                "{name}: {} steps; host wall {:.3} ms, GPU span {span:.3} ms, in operations {busy:.3} ms, between them {:.3} ms\n",
                k.steps,
                k.host.as_secs_f64() * 1e3 / n,
                span - busy
            );
            let mut ops: Vec<_> = k.ops.iter().collect();
            ops.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
            for (op, (ms, calls)) in ops {
                out += &format!("  {op:<28} {:>9.3} ms {:>6.1}% {:>7.1} calls\n", ms / n, 100.0 * ms / n / span.max(1e-9), *calls as f64 / n);
            }
        }
        if self.lost > 0 {
            out += &format!("({} events could not be recorded or read: the figures above miss them)\n", self.lost);
        }
        out
    }
}

#[cfg(feature = "cuda")]
#[derive(Default)]
struct State {
    /// The step under way: its kind (set by `prepare`), its start on the host, its operations'
    /// event pairs in order.
    kind: Option<String>,
    started: Option<Instant>,
    /// Recorded when the step begins: the span runs from it to the last operation's end.
    start_event: Option<CudaEvent>,
    pending: Vec<(&'static str, CudaEvent, CudaEvent)>,
    totals: Totals,
}

#[cfg(feature = "cuda")]
pub(crate) struct Profile {
    stream: std::sync::Arc<CudaStream>,
    state: Mutex<State>,
}

/// Records the end event of an operation when dropped.
#[cfg(feature = "cuda")]
pub(crate) struct Timed<'a> {
    profile: &'a Profile,
    op: &'static str,
    start: Option<CudaEvent>,
}

#[cfg(feature = "cuda")]
impl Drop for Timed<'_> {
    fn drop(&mut self) {
        let Some(start) = self.start.take() else { return };
        let end = self.profile.event();
        let mut s = self.profile.lock();
        match end {
            Some(end) => s.pending.push((self.op, start, end)),
            None => s.totals.lost += 1,
        }
    }
}

#[cfg(feature = "cuda")]
impl Profile {
    /// The profile if `FERRY_CUDA_PROFILE=1`.
    pub(crate) fn from_env(stream: &std::sync::Arc<CudaStream>) -> Option<Profile> {
        std::env::var("FERRY_CUDA_PROFILE").is_ok_and(|v| v == "1").then(|| Profile { stream: stream.clone(), state: Mutex::default() })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn event(&self) -> Option<CudaEvent> {
        self.stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).ok()
    }

    /// Time `op` from now until the guard is dropped.
    pub(crate) fn time(&self, op: &'static str) -> Timed<'_> {
        let start = self.event();
        if start.is_none() {
            self.lock().totals.lost += 1;
        }
        Timed { profile: self, op, start }
    }

    /// A step begins (`Backend::run`).
    pub(crate) fn begin_step(&self) {
        let start = self.event();
        let mut s = self.lock();
        s.pending.clear();
        s.kind = None;
        s.started = Some(Instant::now());
        s.start_event = start;
    }

    /// The step's kind: a decode batch of `seqs` sequences, or a prefill of `rows` rows.
    pub(crate) fn step_kind(&self, decode_only: bool, seqs: usize, rows: usize) {
        self.lock().kind = Some(if decode_only { format!("decode, batch {seqs}") } else { format!("prefill or mixed, {} rows", rows.next_power_of_two()) });
    }

    /// The step ended and its stream was synchronized: add its events up.
    pub(crate) fn end_step(&self) {
        let mut s = self.lock();
        let pending = std::mem::take(&mut s.pending);
        let host = s.started.take().map(|t| t.elapsed()).unwrap_or_default();
        let name = s.kind.take().unwrap_or_else(|| "other".into());
        // Guards are pushed as they drop, so a part (`·`) comes before its operation: the span
        // starts at the step's own event, and ends at the last push, the outermost last end.
        let (Some(first), Some(last)) = (s.start_event.take(), pending.last()) else { return };
        let Ok(span) = first.elapsed_ms(&last.2) else {
            s.totals.lost += 1;
            return;
        };
        let mut times = Vec::with_capacity(pending.len());
        for (op, start, end) in &pending {
            match start.elapsed_ms(end) {
                Ok(ms) => times.push((*op, ms as f64)),
                Err(_) => s.totals.lost += 1,
            }
        }
        s.totals.add_step(name, host, span as f64, &times);
    }

    pub(crate) fn report(&self) -> String {
        self.lock().totals.report()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_averages_per_step_and_leaves_parts_out_of_the_sum() {
        let mut t = Totals::default();
        let step = [("matmul", 3.0), ("· matmul: cast x to 16 bits", 0.5), ("attention", 1.0), ("matmul", 2.0)];
        t.add_step("decode, batch 1".into(), Duration::from_millis(8), 7.0, &step);
        t.add_step("decode, batch 1".into(), Duration::from_millis(10), 9.0, &step);
        t.add_step("prefill or mixed, 2048 rows".into(), Duration::from_millis(90), 80.0, &[("matmul", 60.0)]);
        let r = t.report();
        // Two decode steps: span 8 ms, operations 6 ms (the cast is part of matmul), 2 ms between.
        assert!(r.contains("decode, batch 1: 2 steps; host wall 9.000 ms, GPU span 8.000 ms, in operations 6.000 ms, between them 2.000 ms"), "{r}");
        // matmul: 5 ms per step in two calls, 62.5% of the span, listed first.
        let lines: Vec<&str> = r.lines().collect();
        let first_op = lines.iter().position(|l| l.starts_with("decode")).unwrap() + 1;
        assert!(lines[first_op].trim_start().starts_with("matmul") && lines[first_op].contains("5.000 ms") && lines[first_op].contains("62.5%") && lines[first_op].contains("2.0 calls"), "{r}");
        assert!(r.contains("prefill or mixed, 2048 rows: 1 steps; host wall 90.000 ms, GPU span 80.000 ms, in operations 60.000 ms, between them 20.000 ms"), "{r}");
        assert!(!r.contains("could not be recorded"), "{r}");
        t.lost = 3;
        assert!(t.report().contains("3 events could not be recorded"));
    }
}
