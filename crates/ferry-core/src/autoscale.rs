//! `ferry router --autoscale`'s policy, pure: from what the router measured over the last
//! interval, which split of prefill and decode workers to run next.
//!
//! Two parts:
//! - [`recommend`]: the smallest split whose simulation ([`crate::sim`]) meets the SLOs at the
//!   forecast load (the measured rate with headroom, over the measured prompt and output lengths).
//!   Within a size, the split with the best predicted attainment.
//! - [`Autoscaler::decide`]: when to move and by how much. Up at once to what the plan asks (after
//!   a short cooldown); and when the measured SLO attainment misses the target although the plan
//!   says the split suffices (the model is optimistic), one more worker of the role whose latency
//!   misses: TTFT → prefill, TPOT → decode. Down only after the plan has asked for less for
//!   `down_after` intervals in a row and the longer down-cooldown has passed, one worker at a time
//!   (a worker leaving drains its requests). Never below one worker of each role, never above the
//!   budget.

use crate::arrivals::{poisson_arrivals, uniforms};
use crate::slo::{attainment, Slo};
use crate::sim::{simulate, Calibration, Fleet, SimRequest, Split};
use crate::WorkerRole;
use std::collections::{HashMap, VecDeque};
use std::time::Duration;

/// What the router measured over one interval.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Observed {
    /// Requests that arrived per second.
    pub rate: f64,
    /// (prompt tokens, output tokens) of the requests that finished (a sample of the lengths).
    pub lengths: Vec<(usize, usize)>,
    /// Fraction of the finished requests that met the SLOs (None: none finished).
    pub attainment: Option<f64>,
    /// Fractions that met the TTFT target and the TPOT target alone.
    pub ttft_met: Option<f64>,
    pub tpot_met: Option<f64>,
}

/// A disaggregated split, as the autoscaler moves it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pools {
    pub prefill: usize,
    pub decode: usize,
}

impl Pools {
    pub fn total(&self) -> usize {
        self.prefill + self.decode
    }
}

/// The policy's knobs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Policy {
    pub slo: Slo,
    /// Fraction of requests that must meet the SLOs.
    pub target: f64,
    /// Most workers in all.
    pub max_workers: usize,
    /// The forecast load is the measured rate × (1 + headroom).
    pub headroom: f64,
    /// No move sooner than this after the last one up...
    pub up_cooldown: Duration,
    /// ...or down.
    pub down_cooldown: Duration,
    /// Intervals in a row the plan must ask for fewer workers before one goes.
    pub down_after: u32,
    /// Requests simulated per recommendation.
    pub sim_requests: usize,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            slo: Slo { ttft_ms: 5000.0, tpot_ms: 100.0 },
            target: 0.9,
            max_workers: 8,
            headroom: 0.2,
            up_cooldown: Duration::from_secs(20),
            down_cooldown: Duration::from_secs(60),
            down_after: 3,
            sim_requests: 200,
        }
    }
}

/// The smallest split (at least one worker of each role, at most `max_workers`) predicted to meet
/// the SLOs for `target` of requests at `rate` with these lengths; the largest split tried (the
/// best it could do) when none does. None without lengths to simulate.
pub fn recommend(fleet: &Fleet, rate: f64, lengths: &[(usize, usize)], slo: &Slo, target: f64, max_workers: usize, sim_requests: usize) -> Option<Pools> {
    if lengths.is_empty() || max_workers < 2 {
        return None;
    }
    if rate <= 0.0 {
        return Some(Pools { prefill: 1, decode: 1 });
    }
    let arrivals = poisson_arrivals(rate, sim_requests.max(10), &mut uniforms(0x5eed));
    let reqs: Vec<SimRequest> = arrivals.iter().enumerate().map(|(i, &at)| SimRequest { at, prompt: lengths[i % lengths.len()].0.max(1), output: lengths[i % lengths.len()].1.max(1) }).collect();
    let mut fallback = None;
    for n in 2..=max_workers {
        let mut best: Option<(f64, Pools)> = None;
        for p in 1..n {
            let pools = Pools { prefill: p, decode: n - p };
            let a = attainment(&simulate(fleet, Split::Disaggregated { prefill: p, decode: n - p }, &reqs), slo);
            if best.is_none_or(|(b, _)| a > b) {
                best = Some((a, pools));
            }
        }
        let (a, pools) = best?;
        if a >= target {
            return Some(pools);
        }
        fallback = Some(pools);
    }
    fallback
}

/// What to do this interval.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    Hold(String),
    Scale { to: Pools, why: String },
}

/// The policy's memory between intervals.
#[derive(Clone, Debug, Default)]
pub struct Autoscaler {
    /// When the pools last moved (as an offset from any fixed origin).
    last_move: Option<Duration>,
    /// Intervals in a row the plan asked for fewer prefill / decode workers.
    fewer_prefill: u32,
    fewer_decode: u32,
}

impl Autoscaler {
    /// One interval at `now`: the pools are `current`; the plan recommends `plan` (None: no
    /// recommendation, e.g. nothing finished yet); `seen` is what was measured.
    pub fn decide(&mut self, policy: &Policy, now: Duration, current: Pools, plan: Option<Pools>, seen: &Observed) -> Decision {
        let since = self.last_move.map(|t| now.saturating_sub(t));
        let cooled = |d: Duration| since.is_none_or(|s| s >= d);
        let clamp = |p: Pools| {
            let prefill = p.prefill.max(1);
            let decode = p.decode.max(1);
            let over = (prefill + decode).saturating_sub(policy.max_workers.max(2));
            // Over the budget: trim the larger pool first.
            let (mut prefill, mut decode) = (prefill, decode);
            for _ in 0..over {
                if prefill >= decode && prefill > 1 {
                    prefill -= 1;
                } else if decode > 1 {
                    decode -= 1;
                }
            }
            Pools { prefill, decode }
        };
        let Some(plan) = plan.map(clamp) else {
            return Decision::Hold("no finished requests to plan from yet".into());
        };
        self.fewer_prefill = if plan.prefill < current.prefill { self.fewer_prefill + 1 } else { 0 };
        self.fewer_decode = if plan.decode < current.decode { self.fewer_decode + 1 } else { 0 };
        // Up: what the plan asks, in each role short of it.
        let up = Pools { prefill: current.prefill.max(plan.prefill), decode: current.decode.max(plan.decode) };
        if up != current {
            if !cooled(policy.up_cooldown) {
                return Decision::Hold(format!("the plan asks for {}P:{}D; in the cooldown after the last move", plan.prefill, plan.decode));
            }
            return self.moved(now, clamp(up), format!("predicted to meet the SLOs at {:.2} req/s (+{:.0}% headroom) with {}P:{}D", seen.rate, policy.headroom * 100.0, plan.prefill, plan.decode));
        }
        // The plan says enough, but the measurement says otherwise: grow the role that misses.
        if let (Some(a), Some(ttft), Some(tpot)) = (seen.attainment, seen.ttft_met, seen.tpot_met)
            && a < policy.target
            && current.total() < policy.max_workers
        {
            if !cooled(policy.up_cooldown) {
                return Decision::Hold(format!("SLOs met by {:.0}% (target {:.0}%); in the cooldown after the last move", a * 100.0, policy.target * 100.0));
            }
            let (to, role) = if ttft <= tpot { (Pools { prefill: current.prefill + 1, ..current }, "TTFT") } else { (Pools { decode: current.decode + 1, ..current }, "TPOT") };
            return self.moved(now, to, format!("SLOs met by {:.0}% (target {:.0}%), {role} the one missing", a * 100.0, policy.target * 100.0));
        }
        // Down: one worker at a time, after the plan has asked for fewer long enough.
        let down = if self.fewer_decode >= policy.down_after && current.decode > 1 {
            Some(Pools { decode: current.decode - 1, ..current })
        } else if self.fewer_prefill >= policy.down_after && current.prefill > 1 {
            Some(Pools { prefill: current.prefill - 1, ..current })
        } else {
            None
        };
        match down {
            Some(_) if seen.attainment.is_some_and(|a| a < policy.target) => Decision::Hold("fewer workers are planned, but the SLOs are being missed now".into()),
            Some(_) if !cooled(policy.down_cooldown) => Decision::Hold("fewer workers are planned; in the cooldown after the last move".into()),
            Some(to) => {
                self.fewer_prefill = 0;
                self.fewer_decode = 0;
                self.moved(now, to, format!("{}P:{}D is predicted to meet the SLOs at {:.2} req/s", plan.prefill, plan.decode, seen.rate))
            }
            None => Decision::Hold(format!("{}P:{}D meets the plan", current.prefill, current.decode)),
        }
    }

    fn moved(&mut self, now: Duration, to: Pools, why: String) -> Decision {
        self.last_move = Some(now);
        Decision::Scale { to, why }
    }
}

/// The pools' step time against their profile ([`Calibration`]), from the workers' priced-step
/// counters (each worker's seconds of steps taken and seconds its profile says they take, since
/// it started), over a sliding window of recent looks. A role whose workers ran less than
/// `min_profiled_s` of profiled step time in the window (an idle pool) keeps its last factor.
#[derive(Clone, Debug, Default)]
pub struct Calibrator {
    /// Each worker's counters at the last look.
    last: HashMap<String, (f64, f64)>,
    /// (when, role, seconds taken, seconds profiled) added between two looks.
    deltas: VecDeque<(f64, WorkerRole, f64, f64)>,
    current: Option<Calibration>,
}

/// How much each worker's priced-step counters (seconds taken, seconds profiled) grew from
/// `before` (by worker id) to `now`: (role, seconds taken, seconds profiled) per worker that ran a
/// priced step. A worker absent from `before`, or whose counters went back (it restarted), counts
/// from zero.
pub fn clock_increases<R: Copy>(before: &HashMap<String, (f64, f64)>, now: &[(String, R, f64, f64)]) -> Vec<(R, f64, f64)> {
    now.iter()
        .filter_map(|(id, role, took, profiled)| {
            let (t0, p0) = before.get(id).copied().filter(|&(t0, p0)| *took >= t0 && *profiled >= p0).unwrap_or((0.0, 0.0));
            (*profiled > p0).then(|| (*role, took - t0, profiled - p0))
        })
        .collect()
}

/// A factor outside this range is taken for a broken profile or counter, not a speed.
const FACTOR_RANGE: (f64, f64) = (0.1, 10.0);

impl Calibrator {
    /// One look at time `now` (seconds, any origin) at every worker: (id, role, seconds taken,
    /// seconds profiled). A worker whose counters went back (restarted) counts from zero.
    pub fn observe(&mut self, now: f64, workers: &[(String, WorkerRole, f64, f64)]) {
        for (role, took, profiled) in clock_increases(&self.last, workers) {
            self.deltas.push_back((now, role, took, profiled));
        }
        self.last = workers.iter().map(|(id, _, took, profiled)| (id.clone(), (*took, *profiled))).collect();
    }

    /// The factors over the looks of the last `window` seconds before `now` (older ones are
    /// forgotten).
    pub fn calibration(&mut self, now: f64, window: f64, min_profiled_s: f64) -> Calibration {
        while self.deltas.front().is_some_and(|d| now - d.0 > window) {
            self.deltas.pop_front();
        }
        let mut c = self.current.unwrap_or_default();
        for role in [WorkerRole::Prefill, WorkerRole::Decode, WorkerRole::Colocated] {
            let (took, profiled) = self.deltas.iter().filter(|d| d.1 == role).fold((0.0, 0.0), |(t, p), d| (t + d.2, p + d.3));
            let factor = took / profiled;
            if profiled >= min_profiled_s && (FACTOR_RANGE.0..=FACTOR_RANGE.1).contains(&factor) {
                match role {
                    WorkerRole::Prefill => c.prefill = factor,
                    WorkerRole::Decode => c.decode = factor,
                    WorkerRole::Colocated => c.colocated = factor,
                }
            }
        }
        self.current = Some(c);
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::{CostModel, Linear};
    use crate::sim::KvLink;

    const S: fn(u64) -> Duration = Duration::from_secs;

    fn pools(prefill: usize, decode: usize) -> Pools {
        Pools { prefill, decode }
    }

    fn policy() -> Policy {
        Policy { max_workers: 6, up_cooldown: S(10), down_cooldown: S(30), down_after: 2, ..Policy::default() }
    }

    fn seen(attainment: Option<f64>, ttft_met: f64, tpot_met: f64) -> Observed {
        Observed { rate: 1.0, lengths: vec![(100, 10)], attainment, ttft_met: attainment.map(|_| ttft_met), tpot_met: attainment.map(|_| tpot_met) }
    }

    fn scaled(d: &Decision) -> Option<Pools> {
        match d {
            Decision::Scale { to, .. } => Some(*to),
            Decision::Hold(_) => None,
        }
    }

    #[test]
    fn decisions_over_time() {
        let p = policy();
        let mut a = Autoscaler::default();
        let ok = seen(Some(1.0), 1.0, 1.0);
        // (now s, current, plan, observed, expected move)
        let steps: Vec<(u64, Pools, Option<Pools>, Observed, Option<Pools>)> = vec![
            (0, pools(1, 1), None, seen(None, 0.0, 0.0), None),
            // The plan asks for more prefill: up at once, to what it asks.
            (10, pools(1, 1), Some(pools(3, 1)), ok.clone(), Some(pools(3, 1))),
            // More decode too, but within the up-cooldown: hold.
            (15, pools(3, 1), Some(pools(3, 2)), ok.clone(), None),
            (20, pools(3, 1), Some(pools(3, 2)), ok.clone(), Some(pools(3, 2))),
            // The plan says enough but TPOT misses: one more decode worker.
            (30, pools(3, 2), Some(pools(3, 2)), seen(Some(0.7), 0.95, 0.72), Some(pools(3, 3))),
            // TTFT misses, but 6 workers is the budget: hold.
            (40, pools(3, 3), Some(pools(3, 3)), seen(Some(0.7), 0.7, 1.0), None),
            // Load falls: the plan asks for fewer; down after 2 intervals in a row and the
            // down-cooldown (30 s), one worker at a time, decode first.
            (50, pools(3, 3), Some(pools(1, 1)), ok.clone(), None),
            (60, pools(3, 3), Some(pools(1, 1)), ok.clone(), Some(pools(3, 2))),
            (70, pools(3, 2), Some(pools(1, 1)), ok.clone(), None),
            (80, pools(3, 2), Some(pools(1, 1)), ok.clone(), None),
            (90, pools(3, 2), Some(pools(1, 1)), ok.clone(), Some(pools(3, 1))),
            // Decode at its floor: prefill goes next.
            (100, pools(3, 1), Some(pools(1, 1)), ok.clone(), None),
            (110, pools(3, 1), Some(pools(1, 1)), ok.clone(), None),
            (120, pools(3, 1), Some(pools(1, 1)), ok.clone(), Some(pools(2, 1))),
            // The measurement beats the plan: TTFT misses now, so prefill grows again.
            (130, pools(2, 1), Some(pools(1, 1)), seen(Some(0.5), 0.5, 1.0), Some(pools(3, 1))),
        ];
        for (now, current, plan, observed, want) in steps {
            let d = a.decide(&p, S(now), current, plan, &observed);
            assert_eq!(scaled(&d), want, "at {now}s: {d:?}");
        }
    }

    #[test]
    fn the_budget_and_the_floors_hold() {
        let p = Policy { max_workers: 4, ..policy() };
        let mut a = Autoscaler::default();
        let ok = seen(Some(1.0), 1.0, 1.0);
        // Asked for 5P:3D within 4 workers: trimmed, the larger pool first.
        assert_eq!(scaled(&a.decide(&p, S(0), pools(1, 1), Some(pools(5, 3)), &ok)), Some(pools(2, 2)));
        // Asked for 0 of a role: never below one.
        let mut a = Autoscaler::default();
        for now in 0..5 {
            let d = a.decide(&p, S(now * 100), pools(1, 1), Some(pools(0, 0)), &ok);
            assert_eq!(scaled(&d), None, "{d:?}");
        }
    }

    fn fleet() -> Fleet {
        Fleet {
            cost: CostModel { prefill: Linear { a: 0.0, b: 1e-3, c: 0.0 }, decode: Linear { a: 0.01, b: 1e-3, c: 0.0 }, decode_base: crate::profile::Knots::new(&[]), prefill_fit_error: 0.0, decode_fit_error: 0.0 },
            block_size: 16,
            kv_blocks: 10_000,
            max_batch_tokens: 2048,
            max_context: 8192,
            chunk_tokens: None,
            kv: KvLink { bytes_per_token: 1000, bytes_per_s: 1e9, latency_s: 0.0 },
            calibration: crate::sim::Calibration::PROFILED,
        }
    }

    #[test]
    fn recommendations_grow_with_the_load_and_the_role_that_limits() {
        let f = fleet();
        let slo = Slo { ttft_ms: 1000.0, tpot_ms: 60.0 };
        // Long prompts, short answers: prefill limits (200 ms of prefill each).
        let prompts = [(200, 5)];
        let low = recommend(&f, 1.0, &prompts, &slo, 0.9, 8, 300).unwrap();
        let high = recommend(&f, 12.0, &prompts, &slo, 0.9, 8, 300).unwrap();
        assert_eq!(low, pools(1, 1));
        assert!(high.prefill >= 3 && high.prefill > high.decode, "{high:?}");
        // Short prompts, long answers at a high rate: decode limits (batch grows the step).
        let answers = [(10, 200)];
        let many = recommend(&f, 6.0, &answers, &slo, 0.9, 8, 300).unwrap();
        assert!(many.decode > many.prefill, "{many:?}");
        assert_eq!(recommend(&f, 1.0, &[], &slo, 0.9, 8, 300), None);
        assert_eq!(recommend(&f, 0.0, &prompts, &slo, 0.9, 8, 300), Some(pools(1, 1)));
        // Beyond what the budget can do: the largest split tried.
        let over = recommend(&f, 1000.0, &prompts, &slo, 0.9, 4, 300).unwrap();
        assert_eq!(over.total(), 4);
    }

    #[test]
    fn calibration_follows_the_counters_of_each_role_over_the_window() {
        let w = |id: &str, role, took, profiled| (id.to_string(), role, took, profiled);
        let (p, d) = (WorkerRole::Prefill, WorkerRole::Decode);
        let mut c = Calibrator::default();
        // No counters yet: as profiled.
        assert!(c.calibration(0.0, 30.0, 1.0).is_profiled());
        c.observe(0.0, &[w("prefill-1", p, 10.0, 10.0), w("decode-1", d, 4.0, 8.0)]);
        // The first look counts what the workers ran since they started.
        let k = c.calibration(0.0, 30.0, 1.0);
        assert_eq!((k.prefill, k.decode, k.colocated), (1.0, 0.5, 1.0));
        // Two prefill workers, one at 2x: pooled by time (6 + 2 s taken for 4 s profiled).
        c.observe(10.0, &[w("prefill-1", p, 16.0, 13.0), w("prefill-2", p, 2.0, 1.0), w("decode-1", d, 4.0, 8.0)]);
        let k = c.calibration(10.0, 30.0, 1.0);
        assert!((k.prefill - (10.0 + 8.0) / (10.0 + 4.0)).abs() < 1e-12, "{k:?}");
        // Outside the window only the newest look counts; an idle decode pool keeps its factor.
        let k = c.calibration(35.0, 30.0, 1.0);
        assert!((k.prefill - 2.0).abs() < 1e-12 && k.decode == 0.5, "{k:?}");
        // Too little profiled time to judge: kept too.
        c.observe(40.0, &[w("prefill-1", p, 16.5, 13.1)]);
        assert!((c.calibration(40.0, 4.0, 1.0).prefill - 2.0).abs() < 1e-12);
        // A restarted worker (counters went back) counts from zero; a nonsense factor is ignored.
        c.observe(50.0, &[w("prefill-1", p, 3.0, 2.0)]);
        assert!((c.calibration(50.0, 5.0, 1.0).prefill - 1.5).abs() < 1e-12);
        c.observe(60.0, &[w("prefill-1", p, 1003.0, 3.0)]);
        assert!((c.calibration(60.0, 5.0, 0.5).prefill - 1.5).abs() < 1e-12);
    }
}
