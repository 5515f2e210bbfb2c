//! The arithmetic of an open-loop load test's outcome (DistServe arXiv:2401.09670 §6 measures the
//! same way): latency percentiles, SLO attainment and goodput. Pure; shared by the simulator, the
//! autoscaler's policy and the benchmarks.

/// The p-th percentile (0..=100) of `values`, linearly interpolated between the closest ranks (as
/// numpy's default). NaN for no values.
pub fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let pos = (p.clamp(0.0, 100.0) / 100.0) * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (pos - lo as f64)
}

/// One request's outcome as the client saw it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    pub ok: bool,
    pub ttft_ms: f64,
    /// Mean time per output token after the first (0 with one token).
    pub tpot_ms: f64,
    pub e2e_ms: f64,
    pub output_tokens: usize,
}

/// Latency targets: a request meets the SLO when both hold.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Slo {
    pub ttft_ms: f64,
    pub tpot_ms: f64,
}

impl Slo {
    /// The targets used when none are given: TTFT 5 s, TPOT 100 ms (CPU-scale figures; set yours).
    pub const DEFAULT: Slo = Slo { ttft_ms: 5000.0, tpot_ms: 100.0 };

    pub fn met(&self, s: &Sample) -> bool {
        s.ok && s.ttft_ms <= self.ttft_ms && s.tpot_ms <= self.tpot_ms
    }
}

/// Fraction of requests (failed ones included, as misses) that met the SLO.
pub fn attainment(samples: &[Sample], slo: &Slo) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    samples.iter().filter(|s| slo.met(s)).count() as f64 / samples.len() as f64
}

/// Goodput: the largest offered rate whose run met the SLO for at least `target` of its requests
/// (DistServe's definition; 0.9 is customary). `runs` are (rate, attainment) from a sweep; None
/// when no rate qualified.
pub fn goodput(runs: &[(f64, f64)], target: f64) -> Option<f64> {
    runs.iter().filter(|(_, a)| *a >= target).map(|(r, _)| *r).max_by(f64::total_cmp)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let v = [15.0, 20.0, 35.0, 40.0, 50.0];
        // numpy.percentile(v, [0, 25, 50, 90, 99, 100]) = 15, 20, 35, 46, 49.6, 50
        for (p, want) in [(0.0, 15.0), (25.0, 20.0), (50.0, 35.0), (90.0, 46.0), (99.0, 49.6), (100.0, 50.0)] {
            assert!((percentile(&v, p) - want).abs() < 1e-9, "p{p}: {} vs {want}", percentile(&v, p));
        }
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
        assert!(percentile(&[], 50.0).is_nan());
        // Order does not matter.
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 50.0), 2.0);
    }

    #[test]
    fn attainment_and_goodput() {
        let slo = Slo { ttft_ms: 100.0, tpot_ms: 10.0 };
        let s = |ok, ttft, tpot| Sample { ok, ttft_ms: ttft, tpot_ms: tpot, e2e_ms: 0.0, output_tokens: 1 };
        let samples = [s(true, 50.0, 5.0), s(true, 150.0, 5.0), s(true, 50.0, 11.0), s(false, 1.0, 1.0), s(true, 100.0, 10.0)];
        assert_eq!(attainment(&samples, &slo), 2.0 / 5.0);
        assert_eq!(attainment(&[], &slo), 0.0);
        // (rate, attainment): goodput is the largest rate at >= 90%, even past a dip.
        let runs = [(1.0, 1.0), (2.0, 0.95), (3.0, 0.85), (4.0, 0.91), (5.0, 0.2)];
        assert_eq!(goodput(&runs, 0.9), Some(4.0));
        assert_eq!(goodput(&runs[2..3], 0.9), None);
        assert_eq!(goodput(&[], 0.9), None);
    }
}
