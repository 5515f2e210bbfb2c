//! What the autoscaler measures ([`Window`]): arrivals and finished requests since it last
//! looked, recorded by the pipeline.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ferry_core::autoscale::Observed;
use ferry_core::slo::Slo;

/// While the rate window has not yet filled (the router just started counting), the arrivals so
/// far are taken as a rate over the time since counting began only when there are at least this
/// many of them; fewer count over the whole window. Two arrivals in the first 10 s are 0.2/s ±
/// 0.14, and planning from that grew the pools under a load of 0.1/s; eight are ± 35%, evidence
/// of a load worth planning for at once.
const EARLY_ARRIVALS_TRUSTED: usize = 8;

/// Lengths kept to plan from (the latest finished requests).
const LENGTHS_KEPT: usize = 512;

/// One finished request, as the autoscaler counts it.
#[derive(Clone, Copy, Debug)]
pub struct Finished {
    pub prompt: usize,
    pub output: usize,
    pub ttft_ms: f64,
    pub tpot_ms: f64,
    pub ok: bool,
}

/// What the router saw since the autoscaler last looked.
#[derive(Default)]
pub struct Window {
    inner: Mutex<WindowInner>,
}

#[derive(Default)]
struct WindowInner {
    /// Arrival times within the rate window.
    arrivals: VecDeque<Instant>,
    finished: Vec<Finished>,
    lengths: VecDeque<(usize, usize)>,
}

impl Window {
    pub fn arrived(&self) {
        self.arrived_at(Instant::now());
    }

    fn arrived_at(&self, t: Instant) {
        self.lock().arrivals.push_back(t);
    }

    pub fn finished(&self, f: Finished) {
        let mut w = self.lock();
        if f.ok {
            if w.lengths.len() == LENGTHS_KEPT {
                w.lengths.pop_front();
            }
            w.lengths.push_back((f.prompt, f.output));
        }
        w.finished.push(f);
    }

    /// What happened since the last call (attainment), the arrival rate over the last
    /// `rate_window` (or over `running`, the time since counting began, while that is shorter and
    /// at least [`EARLY_ARRIVALS_TRUSTED`] requests arrived in it: a few arrivals over a short
    /// time overstate a low load as often as not), and start counting again.
    pub fn take(&self, now: Instant, rate_window: Duration, running: Duration, slo: &Slo) -> Observed {
        let mut w = self.lock();
        while w.arrivals.front().is_some_and(|&t| now.saturating_duration_since(t) > rate_window) {
            w.arrivals.pop_front();
        }
        let early = running < rate_window && w.arrivals.len() < EARLY_ARRIVALS_TRUSTED;
        let span = if early { rate_window } else { rate_window.min(running) }.as_secs_f64().max(1e-3);
        let done = std::mem::take(&mut w.finished);
        let frac = |f: &dyn Fn(&Finished) -> bool| (!done.is_empty()).then(|| done.iter().filter(|d| f(d)).count() as f64 / done.len() as f64);
        Observed {
            rate: w.arrivals.len() as f64 / span,
            lengths: w.lengths.iter().copied().collect(),
            attainment: frac(&|d| d.ok && d.ttft_ms <= slo.ttft_ms && d.tpot_ms <= slo.tpot_ms),
            ttft_met: frac(&|d| d.ok && d.ttft_ms <= slo.ttft_ms),
            tpot_met: frac(&|d| d.ok && d.tpot_ms <= slo.tpot_ms),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, WindowInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_counts_and_restarts() {
        let w = Window::default();
        let slo = Slo { ttft_ms: 100.0, tpot_ms: 10.0 };
        let t0 = Instant::now();
        let s = Duration::from_secs;
        for _ in 0..4 {
            w.arrived_at(t0);
        }
        w.finished(Finished { prompt: 10, output: 5, ttft_ms: 50.0, tpot_ms: 5.0, ok: true });
        w.finished(Finished { prompt: 20, output: 6, ttft_ms: 150.0, tpot_ms: 5.0, ok: true });
        w.finished(Finished { prompt: 30, output: 7, ttft_ms: 50.0, tpot_ms: 50.0, ok: true });
        w.finished(Finished { prompt: 40, output: 8, ttft_ms: 1.0, tpot_ms: 1.0, ok: false });
        // 2 s after counting began, with a 6 s rate window: 4 arrivals are too few to take as a
        // rate over 2 s; they count over the whole window.
        let o = w.take(t0 + s(2), s(6), s(2), &slo);
        assert_eq!(o.rate, 4.0 / 6.0);
        assert_eq!(o.lengths, vec![(10, 5), (20, 6), (30, 7)]);
        assert_eq!((o.attainment, o.ttft_met, o.tpot_met), (Some(0.25), Some(0.5), Some(0.5)));
        // The next interval: no finished request, but the rate still counts the 4, and 4 more
        // make 8 arrivals, enough to take as a rate over the 4 s so far.
        for t in [3, 3, 4, 4] {
            w.arrived_at(t0 + s(t));
        }
        let o = w.take(t0 + s(4), s(6), s(4), &slo);
        assert_eq!((o.rate, o.attainment), (2.0, None));
        assert_eq!(o.lengths.len(), 3);
        // Past the window, the first 4 are forgotten: 4 arrivals over the last 6 s (a full
        // window: however few, over its length).
        let o = w.take(t0 + s(8), s(6), s(8), &slo);
        assert_eq!(o.rate, 4.0 / 6.0);
        // Nothing for a whole window: rate 0.
        let o = w.take(t0 + s(20), s(6), s(20), &slo);
        assert_eq!(o.rate, 0.0);
    }
}
