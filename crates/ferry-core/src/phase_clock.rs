//! Where a device-pipe KV transfer's time goes, phase by phase (`FERRY_KV_PIPE_TIMING=1`): the
//! sender's and the receiver's pipe code time their steps (waiting for a descriptor, a checksum,
//! a copy, a confirmation) into process-wide totals, and whoever ends a transfer takes the totals
//! as a report (and resets them). Made for a benchmark's one transfer at a time: concurrent
//! transfers in one process would mix their phases. Off, a phase costs one relaxed load.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

static TOTALS: Mutex<BTreeMap<&'static str, (Duration, u64)>> = Mutex::new(BTreeMap::new());
/// 0: not read yet, 1: off, 2: on.
static STATE: AtomicU8 = AtomicU8::new(0);

/// Whether `FERRY_KV_PIPE_TIMING=1` (read once).
pub fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            let on = std::env::var("FERRY_KV_PIPE_TIMING").is_ok_and(|v| v == "1");
            STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
    }
}

/// Add `d` to `phase`.
pub fn record(phase: &'static str, d: Duration) {
    if enabled() {
        let mut t = TOTALS.lock().unwrap_or_else(|p| p.into_inner());
        let e = t.entry(phase).or_default();
        e.0 += d;
        e.1 += 1;
    }
}

/// Times `phase` until dropped.
pub struct Span(Option<(&'static str, Instant)>);

impl Drop for Span {
    fn drop(&mut self) {
        if let Some((phase, start)) = self.0.take() {
            record(phase, start.elapsed());
        }
    }
}

/// Time `phase` from now until the returned span drops.
pub fn span(phase: &'static str) -> Span {
    Span(enabled().then(|| (phase, Instant::now())))
}

/// The totals since the last report, as text titled `title` (largest first, with each phase's
/// count and mean), and reset; `None` when off or nothing was timed.
fn take_report(title: &str) -> Option<String> {
    if !enabled() {
        return None;
    }
    let t = std::mem::take(&mut *TOTALS.lock().unwrap_or_else(|p| p.into_inner()));
    if t.is_empty() {
        return None;
    }
    Some(format_report(title, t))
}

/// [`take_report`] printed to stderr (where a transfer ends, on either side).
pub fn print_report(title: &str) {
    if let Some(r) = take_report(title) {
        eprint!("{r}");
    }
}

fn format_report(title: &str, t: BTreeMap<&'static str, (Duration, u64)>) -> String {
    let mut rows: Vec<_> = t.into_iter().collect();
    rows.sort_by(|a, b| b.1.0.cmp(&a.1.0));
    let mut out = format!("{title} (FERRY_KV_PIPE_TIMING=1):\n");
    for (phase, (d, n)) in rows {
        let ms = d.as_secs_f64() * 1e3;
        out += &format!("  {phase:<44} {ms:>9.3} ms in {n:>5} ({:>8.1} µs each)\n", ms * 1e3 / n.max(1) as f64);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_are_summed_largest_first_with_their_means() {
        let mut t = BTreeMap::new();
        t.insert("receive: checksum", (Duration::from_micros(90), 3));
        t.insert("send: wait for the descriptor", (Duration::from_millis(4), 32));
        let r = format_report("kv pipe sender", t);
        let lines: Vec<&str> = r.lines().collect();
        assert_eq!(lines[0], "kv pipe sender (FERRY_KV_PIPE_TIMING=1):");
        assert!(lines[1].contains("send: wait for the descriptor") && lines[1].contains("4.000 ms in    32") && lines[1].contains("125.0 µs each"), "{r}");
        assert!(lines[2].contains("receive: checksum") && lines[2].contains("0.090 ms in     3") && lines[2].contains("30.0 µs each"), "{r}");
    }
}
