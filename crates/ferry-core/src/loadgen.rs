//! The arithmetic of an open-loop load test (DistServe arXiv:2401.09670 §6 measures the same way):
//! Poisson arrivals, request lengths, latency percentiles, SLO attainment and goodput. Pure
//! functions; randomness is passed in as a source of uniforms in [0, 1).

/// A deterministic source of uniforms in [0, 1) (SplitMix64, Steele et al.): the same seed gives
/// the same workload.
pub fn uniforms(seed: u64) -> impl FnMut() -> f64 {
    let mut s = seed;
    move || {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Seconds after the start at which each of `n` requests is sent: exponential inter-arrival times
/// of mean `1 / rate` (a Poisson process), the first one after one such gap.
pub fn poisson_arrivals(rate: f64, n: usize, uniform: &mut dyn FnMut() -> f64) -> Vec<f64> {
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            t += -(1.0 - uniform()).ln() / rate;
            t
        })
        .collect()
}

/// How a length is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LenDist {
    Fixed(usize),
    /// Uniform over `lo..=hi`.
    Uniform(usize, usize),
}

impl LenDist {
    pub fn sample(&self, uniform: &mut dyn FnMut() -> f64) -> usize {
        match *self {
            LenDist::Fixed(n) => n,
            LenDist::Uniform(lo, hi) => lo + ((uniform() * (hi - lo + 1) as f64) as usize).min(hi - lo),
        }
    }

    /// `N` or `LO..HI` (inclusive).
    pub fn parse(s: &str) -> Result<LenDist, String> {
        let num = |x: &str| x.trim().parse::<usize>().map_err(|e| format!("bad length {x:?} in {s:?}: {e}"));
        match s.split_once("..") {
            Some((a, b)) => {
                let (lo, hi) = (num(a)?, num(b)?);
                if lo == 0 || lo > hi {
                    return Err(format!("length range {s:?} must be LO..HI with 1 <= LO <= HI"));
                }
                Ok(LenDist::Uniform(lo, hi))
            }
            None => match num(s)? {
                0 => Err("a length must be at least 1".into()),
                n => Ok(LenDist::Fixed(n)),
            },
        }
    }
}

/// One request of the `random` workload.
#[derive(Clone, Debug, PartialEq)]
pub struct RandomRequest {
    /// Seconds after the start at which it is sent.
    pub at: f64,
    /// The prompt: ordinary vocabulary ids (from 256 up: the low ids of byte-level BPE
    /// vocabularies are special).
    pub ids: Vec<u32>,
    /// Tokens to generate (end of sequence ignored).
    pub output: usize,
}

/// The `random` workload of `ferry bench serve`: `count` requests at Poisson arrivals of `rate`,
/// prompt and output lengths drawn from `prompt` and `output`, ids below `vocab`. `ferry plan`
/// simulates the same requests (same seed, same lengths) that `bench serve` sends. The lengths do
/// not depend on the rate: only the arrival times scale with it.
pub fn random_requests(seed: u64, rate: f64, count: usize, prompt: LenDist, output: LenDist, vocab: u32) -> Vec<RandomRequest> {
    let mut u = uniforms(seed);
    let arrivals = poisson_arrivals(rate, count, &mut u);
    arrivals
        .into_iter()
        .map(|at| {
            let n = prompt.sample(&mut u);
            let ids = (0..n).map(|_| 256 + (u() * (vocab.saturating_sub(256).max(1)) as f64) as u32).collect();
            RandomRequest { at, ids, output: output.sample(&mut u) }
        })
        .collect()
}

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

    #[test]
    fn poisson_arrivals_have_the_right_rate_and_reproduce() {
        let a = poisson_arrivals(4.0, 20_000, &mut uniforms(1));
        assert_eq!(a, poisson_arrivals(4.0, 20_000, &mut uniforms(1)));
        assert_ne!(a, poisson_arrivals(4.0, 20_000, &mut uniforms(2)));
        assert!(a.windows(2).all(|w| w[1] > w[0]));
        let rate = a.len() as f64 / a.last().unwrap();
        assert!((rate - 4.0).abs() < 0.1, "measured rate {rate}");
        // Exponential gaps: the coefficient of variation is 1.
        let gaps: Vec<f64> = std::iter::once(a[0]).chain(a.windows(2).map(|w| w[1] - w[0])).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let sd = (gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64).sqrt();
        assert!((sd / mean - 1.0).abs() < 0.05, "cv {}", sd / mean);
    }

    #[test]
    fn random_requests_keep_their_lengths_across_rates() {
        let (pl, ol) = (LenDist::Uniform(32, 512), LenDist::Uniform(32, 96));
        let slow = random_requests(7, 0.5, 40, pl, ol, 49_152);
        let fast = random_requests(7, 2.0, 40, pl, ol, 49_152);
        assert_eq!(slow.len(), 40);
        for (s, f) in slow.iter().zip(&fast) {
            assert_eq!((s.ids.len(), s.output), (f.ids.len(), f.output));
            assert!((s.at - 4.0 * f.at).abs() < 1e-9);
            assert!((32..=512).contains(&s.ids.len()) && (32..=96).contains(&s.output));
            assert!(s.ids.iter().all(|&id| (256..49_152).contains(&id)));
        }
        assert_ne!(slow, random_requests(8, 0.5, 40, pl, ol, 49_152));
    }

    #[test]
    fn lengths_parse_and_stay_in_range() {
        assert_eq!(LenDist::parse("128"), Ok(LenDist::Fixed(128)));
        assert_eq!(LenDist::parse("64..1024"), Ok(LenDist::Uniform(64, 1024)));
        for bad in ["0", "10..5", "a", "5..", "0..4"] {
            assert!(LenDist::parse(bad).is_err(), "{bad}");
        }
        let mut u = uniforms(3);
        let d = LenDist::Uniform(64, 70);
        let draws: Vec<usize> = (0..1000).map(|_| d.sample(&mut u)).collect();
        assert!(draws.iter().all(|&x| (64..=70).contains(&x)));
        assert!(draws.contains(&64) && draws.contains(&70));
        assert_eq!(LenDist::Fixed(9).sample(&mut u), 9);
    }
}
