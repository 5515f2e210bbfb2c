//! `ferry router --autoscale`: every interval the router measures its workload (arrival rate,
//! prompt and output lengths, SLO attainment), asks the planner for the smallest split that meets
//! the SLOs at the forecast load ([`ferry_core::autoscale::recommend`], a simulation over the
//! workers' measured profile), lets the pure policy decide whether and how far to move
//! ([`ferry_core::autoscale::Autoscaler`]: hysteresis, cooldowns, one worker down at a time), and
//! calls the Scaler (Kubernetes, or `ferry up`'s supervisor). Workers that go drain first.
//!
//! The plan is made for the devices as they run now: workers that price their steps against the
//! profile (`--profile`) report how long their steps took against how long the profile says, and
//! the simulation scales each role's steps by that ratio over the rate window
//! ([`ferry_core::autoscale::Calibrator`]); a machine that runs 30% slower than when it was
//! profiled gets the workers it needs at its present speed.

use crate::registry::DialOptions;
use crate::service::Shared;
use ferry_core::autoscale::{recommend, Autoscaler, Calibrator, Decision, Observed, Policy, Pools};
use ferry_core::slo::Slo;
use ferry_core::sim::Fleet;
use ferry_core::WorkerRole;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How the autoscaler runs.
#[derive(Clone, Debug)]
pub struct AutoscaleConfig {
    pub interval: Duration,
    /// The arrival rate is measured over this much of the recent past (at least one interval):
    /// one interval of a few arrivals is a noisy estimate (at 0.6 requests/s, 10 s hold 6 ± 2.4),
    /// and plans from it move the pools back and forth.
    pub rate_window: Duration,
    pub policy: Policy,
    /// The workers, as `ferry profile` measured them.
    pub fleet: Fleet,
    /// Scale each role's steps by the workers' measured step time against the profile (false:
    /// plan at the profile's speed).
    pub calibrate: bool,
}

/// A role's calibration moves only on at least this much profiled step time in the rate window.
const MIN_PROFILED_S: f64 = 1.0;

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

/// Run until the router stops (the task is aborted).
pub async fn run(shared: Arc<Shared>, cfg: AutoscaleConfig, dial: DialOptions) {
    let origin = Instant::now();
    let mut policy_state = Autoscaler::default();
    let mut calibrator = Calibrator::default();
    // What was last asked of the scaler: workers that are starting are not ready yet, and must
    // not be asked for twice.
    let mut target: Option<Pools> = None;
    let mut tick = tokio::time::interval(cfg.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    let counting = Instant::now();
    loop {
        tick.tick().await;
        let now = Instant::now();
        let seen = shared.window.take(now, cfg.rate_window.max(cfg.interval), now - counting, &cfg.policy.slo);
        let crate::registry::Ready { prefill: p, decode: d, .. } = shared.registry.ready();
        let ready = Pools { prefill: p as usize, decode: d as usize };
        let current = target.unwrap_or(ready);
        let since = (now - origin).as_secs_f64();
        calibrator.observe(since, &shared.registry.step_clocks());
        let measured = calibrator.calibration(since, cfg.rate_window.max(cfg.interval).as_secs_f64(), MIN_PROFILED_S);
        let calibration = if cfg.calibrate { measured } else { cfg.fleet.calibration };
        for role in [WorkerRole::Prefill, WorkerRole::Decode] {
            metrics::gauge!("ferry_router_autoscale_step_time_ratio", "role" => role.as_str()).set(measured.of(role));
        }
        let fleet = Fleet { calibration, ..cfg.fleet };
        let (policy, lengths, rate) = (cfg.policy, seen.lengths.clone(), seen.rate);
        let forecast = rate * (1.0 + policy.headroom);
        let plan = tokio::task::spawn_blocking(move || recommend(&fleet, forecast, &lengths, &policy.slo, policy.target, policy.max_workers, policy.sim_requests))
            .await
            .unwrap_or(None);
        let decision = policy_state.decide(&cfg.policy, now - origin, current, plan, &seen);
        metrics::gauge!("ferry_router_autoscale_observed_rate").set(seen.rate);
        if let Some(a) = seen.attainment {
            metrics::gauge!("ferry_router_autoscale_observed_attainment").set(a);
        }
        match decision {
            Decision::Hold(why) => tracing::debug!(rate = seen.rate, ?plan, ready = ?ready, prefill_time = calibration.prefill, decode_time = calibration.decode, "autoscale: hold: {why}"),
            Decision::Scale { to, why } => {
                tracing::info!(rate = seen.rate, from = ?current, ?to, prefill_time = calibration.prefill, decode_time = calibration.decode, "autoscale: {why}");
                let mut ok = true;
                for (role, from, n) in [(WorkerRole::Decode, current.decode, to.decode), (WorkerRole::Prefill, current.prefill, to.prefill)] {
                    if from == n {
                        continue;
                    }
                    let direction = if n > from { "up" } else { "down" };
                    match crate::scale::scale(shared.cfg.scaler.as_ref(), &dial, role, n as u32).await {
                        Ok(_) => {
                            metrics::counter!("ferry_router_autoscale_moves_total", "role" => role.as_str(), "direction" => direction).increment(1);
                            metrics::gauge!("ferry_router_autoscale_target", "role" => role.as_str()).set(n as f64);
                        }
                        Err(e) => {
                            ok = false;
                            tracing::warn!(role = role.as_str(), replicas = n, "autoscale: the scaler refused: {e}");
                        }
                    }
                }
                // After a refusal, look at what is really there next time.
                target = ok.then_some(to);
            }
        }
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
