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

use crate::config::AutoscaleConfig;
use crate::state::Shared;
use crate::workers::dial::DialOptions;
use ferry_core::autoscale::{recommend, Autoscaler, Calibrator, Decision, Pools};
use ferry_core::sim::Fleet;
use ferry_core::WorkerRole;
use std::sync::Arc;
use std::time::Instant;

/// A role's calibration moves only on at least this much profiled step time in the rate window.
const MIN_PROFILED_S: f64 = 1.0;

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
        let crate::workers::load::Ready { prefill: p, decode: d, .. } = shared.registry.ready();
        let ready = Pools { prefill: p as usize, decode: d as usize };
        let current = target.unwrap_or(ready);
        let since = (now - origin).as_secs_f64();
        calibrator.observe(since, &shared.registry.step_clocks());
        let measured = calibrator.calibration(since, cfg.rate_window.max(cfg.interval).as_secs_f64(), MIN_PROFILED_S);
        let calibration = if cfg.calibrate { measured } else { cfg.fleet.calibration };
        for role in [WorkerRole::Prefill, WorkerRole::Decode] {
            metrics::gauge!(crate::metrics::names::AUTOSCALE_STEP_TIME_RATIO, "role" => role.as_str()).set(measured.of(role));
        }
        let fleet = Fleet { calibration, ..cfg.fleet };
        let (policy, lengths, rate) = (cfg.policy, seen.lengths.clone(), seen.rate);
        let forecast = rate * (1.0 + policy.headroom);
        let plan = tokio::task::spawn_blocking(move || recommend(&fleet, forecast, &lengths, &policy.slo, policy.target, policy.max_workers, policy.sim_requests))
            .await
            .unwrap_or(None);
        let decision = policy_state.decide(&cfg.policy, now - origin, current, plan, &seen);
        metrics::gauge!(crate::metrics::names::AUTOSCALE_OBSERVED_RATE).set(seen.rate);
        if let Some(a) = seen.attainment {
            metrics::gauge!(crate::metrics::names::AUTOSCALE_OBSERVED_ATTAINMENT).set(a);
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
                    match crate::ops::scale::scale(shared.cfg.scaler.as_ref(), &dial, role, n as u32).await {
                        Ok(_) => {
                            metrics::counter!(crate::metrics::names::AUTOSCALE_MOVES, "role" => role.as_str(), "direction" => direction).increment(1);
                            metrics::gauge!(crate::metrics::names::AUTOSCALE_TARGET_REPLICAS, "role" => role.as_str()).set(n as f64);
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
