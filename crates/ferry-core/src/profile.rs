//! A worker's measured step costs (`ferry profile` writes them), and the cost model the planner
//! ([`crate::sim`]) fits to them.
//!
//! What is measured is one engine step at a time, on the machine that will serve:
//! - prefill steps of `prompts` prompts of `prompt_tokens` tokens each (a prompt alone, and
//!   batches of them), and
//! - decode steps of `batch` sequences each `context` tokens long.
//!
//! The cost model is linear in the work a step does, fitted per phase by least squares on
//! relative error (a 5 ms step counts as much as a 2 s one):
//! - a **prefill** (or mixed) step costs `a + b·T + c·A`: `T` tokens computed (the weight GEMMs)
//!   and `A` query-key pairs attended (`n·(d + (n+1)/2)` for a chunk of `n` tokens after `d`
//!   already computed; a decode row in a mixed step adds one token and its context);
//! - a **decode** step costs `base(B) + c·C`: `C` context tokens attended in all, and a part that
//!   depends on the batch `B` alone, interpolated between the measured batch sizes (piecewise
//!   linear, extended along the end segments): on a CPU each row costs more as the batch grows
//!   (measured: ~10 ms a row from 1 to 2, ~21 ms from 4 to 16), which a line in `B` misses by 25%.
//!   `c` comes from the linear fit `a + b·B + c·C`.
//!
//! The fit's worst relative error over the measured points is kept with the model
//! ([`CostModel::fit_error`]): a planner whose model misses its own calibration by 20% should not
//! be trusted to 15%.

use serde::{Deserialize, Serialize};

/// The profile file's format version.
pub const PROFILE_FORMAT: u32 = 1;

/// What `ferry profile` measured on one machine for one model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub format: u32,
    /// The model (its file stem or repo name) and the engine's fingerprint of it.
    pub model: String,
    pub fingerprint: String,
    /// Where it was measured (free text: CPU model, cores, device).
    pub machine: String,
    /// Compute threads of the measured engine (a worker should run with as many).
    pub threads: usize,
    /// When (RFC 3339, UTC).
    pub measured_at: String,
    pub block_size: usize,
    /// KV blocks one worker holds with the measured configuration.
    pub kv_blocks: usize,
    pub max_batch_tokens: usize,
    pub max_context: usize,
    /// Bytes of KV one token takes (all layers, K and V): what a transfer ships per token.
    pub kv_bytes_per_token: usize,
    /// What the measured engine's KV cache stored (profiles from before the field: f32).
    #[serde(default)]
    pub kv_dtype: crate::KvDtype,
    pub prefill: Vec<PrefillPoint>,
    pub decode: Vec<DecodePoint>,
}

/// A disk tier's cost (issue 38: `--kv-disk`), read from the same profile file as [`Profile`]:
/// `"disk_read_s_per_token"` beside the measured points, seconds to load one prompt token's KV
/// from the tier instead of computing it. Optional (None: not measured; profiles from before the
/// field, and `ferry profile`, which does not measure a disk tier yet, have none).
///
/// Its own struct rather than a field of [`Profile`] for now: a new field would break every
/// `Profile { .. }` literal, one of them in the engine's tests; it moves into [`Profile`] once
/// `ferry profile` measures it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DiskTierCost {
    #[serde(default)]
    pub disk_read_s_per_token: Option<f64>,
}

/// One measured prefill step: `prompts` prompts of `prompt_tokens` tokens each, from scratch.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PrefillPoint {
    pub prompts: usize,
    pub prompt_tokens: usize,
    /// Median seconds of the repeats.
    pub seconds: f64,
}

/// One measured decode step: `batch` sequences, each `context` tokens long before the step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecodePoint {
    pub batch: usize,
    pub context: usize,
    pub seconds: f64,
}

/// Query-key pairs a chunk of `n` tokens attends after `done` tokens of its sequence (causal).
pub fn attention_pairs(done: usize, n: usize) -> f64 {
    n as f64 * (done as f64 + (n as f64 + 1.0) / 2.0)
}

/// `a + b·x + c·y`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Linear {
    pub a: f64,
    pub b: f64,
    pub c: f64,
}

impl Linear {
    pub fn at(&self, x: f64, y: f64) -> f64 {
        self.a + self.b * x + self.c * y
    }

    /// Least squares on relative error over `(x, y, t)`, every coefficient at least 0 (a step
    /// never gets cheaper with more tokens or more attention: a negative coefficient only fits
    /// noise, and extrapolates into nonsense). None when the points do not determine the
    /// coefficients (fewer than three, or all on one line).
    pub fn fit(points: &[(f64, f64, f64)]) -> Option<Linear> {
        // Rows r = [1, x, y] / t against 1: minimise sum((r·k - 1)^2) = k'Mk - 2v'k + n.
        let mut m = [[0.0f64; 3]; 3];
        let mut v = [0.0f64; 3];
        for &(x, y, t) in points {
            if !(t > 0.0) {
                continue;
            }
            let r = [1.0 / t, x / t, y / t];
            for i in 0..3 {
                for j in 0..3 {
                    m[i][j] += r[i] * r[j];
                }
                v[i] += r[i];
            }
        }
        let [a, b, c] = solve(&m, &v, [true; 3])?;
        if a >= 0.0 && b >= 0.0 && c >= 0.0 {
            return Some(Linear { a, b, c });
        }
        // The non-negative optimum has some coefficients at 0 and the rest the least-squares
        // solution over them: try every such set (seven), keep the best that is non-negative.
        let cost = |k: &[f64; 3]| (0..3).map(|i| k[i] * ((0..3).map(|j| m[i][j] * k[j]).sum::<f64>() - 2.0 * v[i])).sum::<f64>();
        (1u8..7)
            .filter_map(|set| solve(&m, &v, [set & 1 != 0, set & 2 != 0, set & 4 != 0]))
            .filter(|k| k.iter().all(|&x| x >= 0.0))
            .min_by(|p, q| cost(p).total_cmp(&cost(q)))
            .map(|[a, b, c]| Linear { a, b, c })
    }
}

/// Solve `m · x = v` over the coefficients marked `free` (the others 0) by Gaussian elimination
/// with partial pivoting; None when singular.
fn solve(m: &[[f64; 3]; 3], v: &[f64; 3], free: [bool; 3]) -> Option<[f64; 3]> {
    let idx: Vec<usize> = (0..3).filter(|&i| free[i]).collect();
    let n = idx.len();
    let mut a: Vec<Vec<f64>> = idx.iter().map(|&i| idx.iter().map(|&j| m[i][j]).collect()).collect();
    let mut b: Vec<f64> = idx.iter().map(|&i| v[i]).collect();
    let scale = a.iter().flatten().fold(0.0f64, |s, x| s.max(x.abs()));
    for col in 0..n {
        let pivot = (col..n).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() <= scale * 1e-12 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        for row in col + 1..n {
            let f = a[row][col] / a[col][col];
            for k in col..n {
                a[row][k] -= f * a[col][k];
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0; 3];
    for row in (0..n).rev() {
        let s: f64 = (row + 1..n).map(|k| a[row][k] * x[idx[k]]).sum();
        x[idx[row]] = (b[row] - s) / a[row][row];
    }
    x.iter().all(|x| x.is_finite()).then_some(x)
}

/// Most knots a [`Knots`] keeps.
pub const MAX_KNOTS: usize = 16;

/// A piecewise-linear function through up to [`MAX_KNOTS`] points, extended along its end
/// segments (a constant with one point; nothing with none).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Knots {
    pub n: usize,
    pub x: [f64; MAX_KNOTS],
    pub y: [f64; MAX_KNOTS],
}

impl Knots {
    /// Through `points`; points at the same x are averaged; beyond [`MAX_KNOTS`] x values, the
    /// largest are dropped.
    pub fn new(points: &[(f64, f64)]) -> Knots {
        let mut pts: Vec<(f64, f64)> = points.iter().copied().filter(|p| p.0.is_finite() && p.1.is_finite()).collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut k = Knots { n: 0, x: [0.0; MAX_KNOTS], y: [0.0; MAX_KNOTS] };
        let mut i = 0;
        while i < pts.len() && k.n < MAX_KNOTS {
            let same: Vec<f64> = pts[i..].iter().take_while(|p| p.0 == pts[i].0).map(|p| p.1).collect();
            k.x[k.n] = pts[i].0;
            k.y[k.n] = same.iter().sum::<f64>() / same.len() as f64;
            k.n += 1;
            i += same.len();
        }
        k
    }

    pub fn at(&self, x: f64) -> f64 {
        match self.n {
            0 => f64::NAN,
            1 => self.y[0],
            n => {
                // The segment x falls in, or the first / last one beyond the ends.
                let i = (1..n - 1).find(|&i| x < self.x[i]).map_or(n - 2, |i| i - 1);
                let (x0, x1, y0, y1) = (self.x[i], self.x[i + 1], self.y[i], self.y[i + 1]);
                y0 + (y1 - y0) * (x - x0) / (x1 - x0)
            }
        }
    }
}

/// Step costs fitted to a [`Profile`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Seconds of a step computing `T` tokens attending `A` pairs.
    pub prefill: Linear,
    /// The linear fit of a decode step of `B` rows attending `C` context tokens in all (its `c`
    /// prices the context).
    pub decode: Linear,
    /// A decode step's part that depends on the batch alone, at the measured batch sizes (empty:
    /// the linear fit's `a + b·B`).
    pub decode_base: Knots,
    /// The worst relative error of each fit over its own points.
    pub prefill_fit_error: f64,
    pub decode_fit_error: f64,
}

/// The shortest step the model will predict (a fit may extrapolate below zero).
const MIN_STEP_S: f64 = 1e-5;

impl CostModel {
    pub fn fit(p: &Profile) -> Result<CostModel, String> {
        let pre: Vec<(f64, f64, f64)> = p
            .prefill
            .iter()
            .map(|q| ((q.prompts * q.prompt_tokens) as f64, q.prompts as f64 * attention_pairs(0, q.prompt_tokens), q.seconds))
            .collect();
        let dec: Vec<(f64, f64, f64)> = p.decode.iter().map(|q| (q.batch as f64, (q.batch * (q.context + 1)) as f64, q.seconds)).collect();
        let prefill = Linear::fit(&pre).ok_or("the profile's prefill points do not determine a cost model (need 3+ points of different sizes)")?;
        let decode = Linear::fit(&dec).ok_or("the profile's decode points do not determine a cost model (need 3+ points of different batches and contexts)")?;
        let decode_base = Knots::new(&dec.iter().map(|&(b, c, t)| (b, t - decode.c * c)).collect::<Vec<_>>());
        let mut m = CostModel { prefill, decode, decode_base, prefill_fit_error: 0.0, decode_fit_error: 0.0 };
        let worst = |f: &dyn Fn(f64, f64) -> f64, pts: &[(f64, f64, f64)]| pts.iter().map(|&(x, y, t)| ((f(x, y).max(MIN_STEP_S) - t) / t).abs()).fold(0.0, f64::max);
        m.prefill_fit_error = worst(&|x, y| prefill.at(x, y), &pre);
        m.decode_fit_error = worst(&|b, c| m.decode_at(b, c), &dec);
        Ok(m)
    }

    /// Seconds of a decode step of `rows` rows attending `context` tokens in all.
    fn decode_at(&self, rows: f64, context: f64) -> f64 {
        let base = if self.decode_base.n >= 2 { self.decode_base.at(rows) } else { self.decode.a + self.decode.b * rows };
        base + self.decode.c * context
    }

    /// Seconds of a step of `decodes` rows (their contexts summing to `decode_context`) and prompt
    /// chunks `(done, n)`. A step with any prompt chunk is priced as a prefill step (its GEMMs
    /// dominate), each decode row adding a token and its context's attention.
    pub fn step(&self, decodes: usize, decode_context: usize, chunks: &[(usize, usize)]) -> f64 {
        let t = if chunks.is_empty() {
            self.decode_at(decodes as f64, (decode_context + decodes) as f64)
        } else {
            let tokens = decodes + chunks.iter().map(|c| c.1).sum::<usize>();
            let pairs = (decode_context + decodes) as f64 + chunks.iter().map(|&(d, n)| attention_pairs(d, n)).sum::<f64>();
            self.prefill.at(tokens as f64, pairs)
        };
        t.max(MIN_STEP_S)
    }

    /// Prompt tokens per second one worker prefills, for a typical prompt of `prompt_tokens`
    /// (what a prefill worker reports to the router once it has run).
    pub fn prefill_rate(&self, prompt_tokens: usize) -> f64 {
        let n = prompt_tokens.max(1);
        n as f64 / self.step(0, 0, &[(0, n)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(mut pre: impl FnMut(usize, usize) -> f64, mut dec: impl FnMut(usize, usize) -> f64) -> Profile {
        let mut prefill = Vec::new();
        for prompts in [1, 2, 4] {
            for n in [16, 64, 256] {
                prefill.push(PrefillPoint { prompts, prompt_tokens: n, seconds: pre(prompts, n) });
            }
        }
        let mut decode = Vec::new();
        for batch in [1, 4, 16] {
            for context in [64, 512] {
                decode.push(DecodePoint { batch, context, seconds: dec(batch, context) });
            }
        }
        Profile {
            format: PROFILE_FORMAT,
            model: "m".into(),
            fingerprint: "f".into(),
            machine: "test".into(),
            threads: 1,
            measured_at: "2026-12-03T00:00:00Z".into(),
            block_size: 16,
            kv_blocks: 1000,
            max_batch_tokens: 2048,
            max_context: 8192,
            kv_bytes_per_token: 1000,
            kv_dtype: Default::default(),
            prefill,
            decode,
        }
    }

    #[test]
    fn an_exactly_linear_machine_is_fitted_exactly() {
        let pre = |k: usize, n: usize| 0.01 + 2e-3 * (k * n) as f64 + 1e-6 * k as f64 * attention_pairs(0, n);
        let dec = |b: usize, c: usize| 0.02 + 1e-3 * b as f64 + 2e-6 * (b * (c + 1)) as f64;
        let m = CostModel::fit(&profile(pre, dec)).unwrap();
        assert!((m.prefill.a - 0.01).abs() < 1e-9 && (m.prefill.b - 2e-3).abs() < 1e-9 && (m.prefill.c - 1e-6).abs() < 1e-12, "{m:?}");
        assert!((m.decode.a - 0.02).abs() < 1e-9 && (m.decode.b - 1e-3).abs() < 1e-9 && (m.decode.c - 2e-6).abs() < 1e-12, "{m:?}");
        assert!(m.prefill_fit_error < 1e-9 && m.decode_fit_error < 1e-9);
        // Steps the profile never measured: a decode step, a chunk after a prefix, a mixed step.
        assert!((m.step(8, 8 * 100, &[]) - dec(8, 100)).abs() < 1e-9);
        let chunk = 0.01 + 2e-3 * 32.0 + 1e-6 * attention_pairs(100, 32);
        assert!((m.step(0, 0, &[(100, 32)]) - chunk).abs() < 1e-9);
        let mixed = 0.01 + 2e-3 * 36.0 + 1e-6 * (attention_pairs(0, 32) + 4.0 * 51.0);
        assert!((m.step(4, 200, &[(0, 32)]) - mixed).abs() < 1e-9);
        assert!((m.prefill_rate(64) - 64.0 / pre(1, 64)).abs() < 1e-6);
    }

    #[test]
    fn a_decode_cost_that_bends_with_the_batch_is_followed() {
        // Each row costs more as the batch grows (as measured on a CPU), plus the context.
        let base = |b: usize| 0.008 + 0.01 * b as f64 + 0.0008 * (b * b) as f64;
        let m = CostModel::fit(&profile(|k, n| 0.01 + 2e-3 * (k * n) as f64, |b, c| base(b) + 1e-6 * (b * (c + 1)) as f64)).unwrap();
        // (The context slope comes from the linear fit, a little off when the batch part bends.)
        assert!(m.decode_fit_error < 0.01, "{m:?}");
        // Between measured batches (4 and 16 here) the interpolation is the chord of the bend:
        // above the convex curve, by less than a quarter on this coarse grid.
        let t8 = m.step(8, 8 * 100, &[]);
        let want = base(8) + 1e-6 * (8.0 * 101.0);
        assert!(t8 >= want && t8 < want * 1.25, "{t8} vs {want}");
        // Beyond the largest, along the last segment.
        assert!(m.step(32, 32 * 64, &[]) > m.step(16, 16 * 64, &[]));
    }

    #[test]
    fn knots_interpolate_and_extend() {
        let k = Knots::new(&[(4.0, 40.0), (1.0, 10.0), (2.0, 20.0), (2.0, 22.0)]);
        assert_eq!(k.n, 3);
        assert_eq!(k.at(2.0), 21.0);
        assert!((k.at(3.0) - (21.0 + 19.0 / 2.0)).abs() < 1e-12);
        assert!((k.at(0.0) - (10.0 - 11.0)).abs() < 1e-12);
        assert!((k.at(6.0) - (40.0 + 19.0)).abs() < 1e-12);
        assert_eq!(Knots::new(&[(5.0, 7.0)]).at(100.0), 7.0);
        assert!(Knots::new(&[]).at(1.0).is_nan());
    }

    #[test]
    fn noise_shows_in_the_fit_error() {
        let mut flip = 1.0;
        let pre = |k: usize, n: usize| 0.01 + 2e-3 * (k * n) as f64;
        let dec = |b: usize, _c: usize| {
            flip = -flip;
            (0.02 + 1e-3 * b as f64) * (1.0 + 0.1 * flip)
        };
        let m = CostModel::fit(&profile(pre, dec)).unwrap();
        assert!(m.prefill_fit_error < 1e-9);
        assert!(m.decode_fit_error > 0.05 && m.decode_fit_error < 0.3, "{}", m.decode_fit_error);
    }

    #[test]
    fn too_few_points_are_refused() {
        let mut p = profile(|_, _| 1.0, |_, _| 1.0);
        p.decode.truncate(2);
        assert!(CostModel::fit(&p).unwrap_err().contains("decode"));
        let mut p = profile(|_, _| 1.0, |_, _| 1.0);
        p.prefill.retain(|q| q.prompts == 1 && q.prompt_tokens == 16);
        assert!(CostModel::fit(&p).unwrap_err().contains("prefill"));
        assert!(Linear::fit(&[]).is_none());
    }

    #[test]
    fn coefficients_are_never_negative() {
        // Steps that grow with tokens but, through noise, less than linearly in attention: the
        // free least-squares fit gives attention a negative cost (this was a real profile of
        // SmolLM2 on a shared 2-core VM: -4.1 µs per attended pair).
        let pts: Vec<(f64, f64, f64)> = [(32.0, 0.59), (128.0, 1.26), (256.0, 2.9), (512.0, 5.0), (64.0, 0.8), (1024.0, 8.9)]
            .iter()
            .map(|&(n, t)| (n, attention_pairs(0, n as usize), t))
            .collect();
        let k = Linear::fit(&pts).unwrap();
        assert_eq!(k.c, 0.0, "the free fit's attention cost is negative (-4e-7 s a pair), the bounded one 0: {k:?}");
        assert!(k.a >= 0.0 && k.b >= 0.0 && k.c >= 0.0, "{k:?}");
        assert!(k.b > 0.0, "the per-token cost carries the steps: {k:?}");
        // It is the best non-negative fit: no nearby non-negative coefficients fit better.
        let loss = |k: &Linear| pts.iter().map(|&(x, y, t)| ((k.at(x, y) - t) / t).powi(2)).sum::<f64>();
        for (da, db, dc) in [(1e-3, 0.0, 0.0), (-1e-3, 0.0, 0.0), (0.0, 1e-5, 0.0), (0.0, -1e-5, 0.0), (0.0, 0.0, 1e-8)] {
            let near = Linear { a: (k.a + da).max(0.0), b: (k.b + db).max(0.0), c: (k.c + dc).max(0.0) };
            assert!(loss(&near) >= loss(&k) - 1e-12, "{near:?} fits better than {k:?}");
        }
        // Exact non-negative data is fitted exactly, as before.
        let exact: Vec<(f64, f64, f64)> = [(16.0, 3.0), (64.0, 1.0), (256.0, 7.0), (32.0, 2.0)].iter().map(|&(x, y)| (x, y, 0.1 + 0.01 * x + 0.002 * y)).collect();
        let e = Linear::fit(&exact).unwrap();
        assert!((e.a - 0.1).abs() < 1e-9 && (e.b - 0.01).abs() < 1e-9 && (e.c - 0.002).abs() < 1e-9, "{e:?}");
    }
}
