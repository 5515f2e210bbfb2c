//! `ferry bench serve`'s and `ferry plan`'s load generator: request lengths and the `random`
//! workload (moved here from `ferry-core`, which keeps only what the simulator and the autoscaler
//! need: [`ferry_core::arrivals`] and [`ferry_core::slo`], re-exported here for the benches).
//! Pure functions; randomness is passed in as a source of uniforms in [0, 1).

pub use ferry_core::arrivals::{poisson_arrivals, uniforms};
pub use ferry_core::slo::{attainment, goodput, percentile, Sample, Slo};

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

/// The `random` workload of `ferry bench serve` for the `rate_index`-th rate of a sweep: `count`
/// requests at Poisson arrivals of `rate`, prompt and output lengths drawn from `prompt` and
/// `output`, ids below `vocab`. `ferry plan` simulates the same requests (same seed, same lengths)
/// that `bench serve` sends. The lengths do not depend on the rate: only the arrival times scale
/// with it. The ids do: every id is shifted by an offset drawn from the rate and its place in the
/// sweep, so a sweep's later rates share no prefix with its earlier ones, even at the same rate
/// (the same prompts again would be served from the workers' prefix caches, and the sweep would
/// measure the cache). The first rate's offset is the one before the place counted (2026-12-06).
pub fn random_requests(seed: u64, rate_index: usize, rate: f64, count: usize, prompt: LenDist, output: LenDist, vocab: u32) -> Vec<RandomRequest> {
    let mut u = uniforms(seed);
    let arrivals = poisson_arrivals(rate, count, &mut u);
    let span = vocab.saturating_sub(256).max(1);
    let shift = (uniforms(rate_seed(seed, rate_index) ^ rate.to_bits().rotate_left(29))() * span as f64) as u32;
    arrivals
        .into_iter()
        .map(|at| {
            let n = prompt.sample(&mut u);
            let ids = (0..n).map(|_| 256 + ((u() * span as f64) as u32 + shift) % span).collect();
            RandomRequest { at, ids, output: output.sample(&mut u) }
        })
        .collect()
}

/// The seed of the `rate_index`-th rate of a sweep: `seed` itself for the first, another one for
/// each later rate (so no rate replays an earlier one's prompts into the prefix caches).
pub fn rate_seed(seed: u64, rate_index: usize) -> u64 {
    seed ^ (rate_index as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93)
}

/// `bench serve`'s `outputs_digest`: a 64-bit FNV-1a hash, in hex, over a run's answers in
/// request order (each its token ids, little-endian, and its text; a failed request, None, counts
/// as a marker of its own). Two runs with the same answers have the same digest; it is stable
/// across builds and machines (FNV-1a, Fowler, Noll and Vo, is defined byte by byte).
pub fn outputs_digest(answers: &[Option<(&[u32], &str)>]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for a in answers {
        match a {
            // Each part is preceded by its length, so no two lists of answers run together alike.
            Some((ids, text)) => {
                eat(&[1]);
                eat(&(ids.len() as u64).to_le_bytes());
                ids.iter().for_each(|id| eat(&id.to_le_bytes()));
                eat(&(text.len() as u64).to_le_bytes());
                eat(text.as_bytes());
            }
            None => eat(&[0]),
        }
    }
    format!("{h:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_outputs_digest_tells_answers_apart_in_order() {
        // FNV-1a 64 of the empty input is its offset basis.
        assert_eq!(outputs_digest(&[]), "cbf29ce484222325");
        let (a, b): (&[u32], &[u32]) = (&[1, 2], &[3]);
        let d = outputs_digest(&[Some((a, "x y")), Some((b, "z"))]);
        assert_eq!(d, outputs_digest(&[Some((a, "x y")), Some((b, "z"))]));
        assert_ne!(d, outputs_digest(&[Some((b, "z")), Some((a, "x y"))]));
        assert_ne!(d, outputs_digest(&[Some((a, "x y")), None]));
        assert_ne!(outputs_digest(&[Some((a, "ab")), Some((b, ""))]), outputs_digest(&[Some((a, "a")), Some((b, "b"))]));
    }

    #[test]
    fn random_requests_keep_their_lengths_across_rates() {
        let (pl, ol) = (LenDist::Uniform(32, 512), LenDist::Uniform(32, 96));
        let slow = random_requests(7, 0, 0.5, 40, pl, ol, 49_152);
        let fast = random_requests(7, 1, 2.0, 40, pl, ol, 49_152);
        assert_eq!(slow.len(), 40);
        for (s, f) in slow.iter().zip(&fast) {
            assert_eq!((s.ids.len(), s.output), (f.ids.len(), f.output));
            assert!((s.at - 4.0 * f.at).abs() < 1e-9);
            assert!((32..=512).contains(&s.ids.len()) && (32..=96).contains(&s.output));
            assert!(s.ids.iter().all(|&id| (256..49_152).contains(&id)));
        }
        assert_ne!(slow, random_requests(8, 0, 0.5, 40, pl, ol, 49_152));
        // Another rate's prompts share no first token (so no cached prefix) with this one's.
        assert!(slow.iter().zip(&fast).all(|(s, f)| s.ids[0] != f.ids[0]), "a later rate replays the prompts into the prefix cache");
        // Nor does the same rate again later in the sweep.
        let again = random_requests(7, 2, 0.5, 40, pl, ol, 49_152);
        assert!(slow.iter().zip(&again).all(|(s, a)| s.ids[0] != a.ids[0] && s.ids.len() == a.ids.len()), "a repeated rate replays the prompts");
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
