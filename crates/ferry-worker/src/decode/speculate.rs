//! Speculative decoding without a second model, on decode and colocated workers.
//!
//! Each step, a running sequence may carry, after its last token, up to K tokens a proposer
//! guessed ([`ferry_core::spec`]: prompt lookup over the sequence's own tokens, or a worker-wide
//! suffix index over earlier prompts and outputs). The step computes logits at every one of those
//! positions in the same forward pass as the rest of the batch; the sequence's picker then chooses
//! its tokens from them in order, exactly as it would one step at a time, and a proposed token is
//! kept only when it is the token chosen at its position. The first mismatch ends the run: the
//! chosen token is emitted (it is what plain decoding gives there), and the KV of the proposals
//! after it is rolled back (`Engine::truncate`).
//!
//! So the output is the output without speculation, by construction: greedy and seeded sampling
//! draw the same token at each position (the draw for completion token i depends on the seed and
//! i alone), an unseeded sampler keeps its distribution, a grammar masks and commits exactly the
//! chosen tokens, logprobs are those of the chosen tokens' rows. What can differ is only the
//! numerics of a step: on the CPU a verified row is computed bit for bit as the decode row it
//! replaces as long as the step stays within the backend's few-row regime ([`Speculator::new`]'s
//! `row_budget`), which is why the proposals of a step never take it past that budget.
//!
//! How many tokens to propose adapts per sequence: an estimate `a` of the chance that a proposed
//! token is accepted (an exponential average over verified proposals, and over the first
//! proposal of steps that verify none, which costs nothing to check) picks the K that maximizes
//! tokens per unit of step time, `(1 + a + a^2 + ... + a^K) / cost(K)`, where `cost(K)` is a step
//! of K + 1 rows relative to a decode step ([`RowCost`]), when that rate clears `MIN_GAIN` (1.1).
//! A sequence with nothing to copy proposes nothing (no match) or soon K = 0.

use std::time::{Duration, Instant};

use ferry_core::spec::{ngram_propose, DocId, SpecMode, SuffixIndex};

/// Speculation settings of a worker (`--speculate`, `--spec-tokens`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecConfig {
    pub mode: SpecMode,
    /// Most tokens proposed per sequence per step (K).
    pub max_tokens: usize,
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig { mode: SpecMode::Off, max_tokens: DEFAULT_SPEC_TOKENS }
    }
}

/// The default K.
pub const DEFAULT_SPEC_TOKENS: usize = 5;
/// The largest K a worker takes: a verified run is K + 1 rows of one sequence, and the CPU
/// attention computes a sequence's rows as decode rows up to 8 of them.
pub const MAX_SPEC_TOKENS: usize = 7;

/// Prompt lookup: the shortest and longest suffix of a sequence matched against its own earlier
/// tokens.
const NGRAM_MIN: usize = 2;
const NGRAM_MAX: usize = 6;
/// The suffix index: tokens kept (earlier prompts and outputs: a few hundred requests; each
/// token adds up to `SUFFIX_ORDER` counted contexts), the longest context it counts, the
/// shortest it proposes from, and the least probability a proposed run may have.
const SUFFIX_TOKENS: usize = 1 << 17;
const SUFFIX_ORDER: usize = 6;
const SUFFIX_MIN_ORDER: usize = 2;
const SUFFIX_MIN_PROB: f32 = 0.1;
/// What a step of K + 1 rows of one sequence costs relative to a decode step of one row:
/// `1 + linear·K + square·K²`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct RowCost {
    pub linear: f32,
    pub square: f32,
}

impl RowCost {
    fn of(self, k: usize) -> f32 {
        let k = k as f32;
        1.0 + self.linear * k + self.square * k * k
    }
}

/// On the CPU (SmolLM2 Q4_1, q8 activations, 512 tokens of context, `ferry bench spec-rows`):
/// 2 rows cost 1.17-1.2x one, 4 rows 1.74x, 8 rows 3.36x, 12 rows 5.4x (docs/benchmarks.md,
/// issue #36), which this fits within 4%. More rows cost more each: the row-dot kernels are
/// compute-bound past one row on a CPU.
const CPU_ROW_COST: RowCost = RowCost { linear: 0.2, square: 0.02 };
/// On a GPU a decode step reads all the weights whatever its rows, up to `GPU_ROW_BUDGET` of
/// them (an estimate: untested on a GPU).
const GPU_ROW_COST: RowCost = RowCost { linear: 0.02, square: 0.0 };
const GPU_ROW_BUDGET: usize = 64;
/// The least expected gain in tokens per unit of step time for which a sequence proposes: the
/// acceptance is a noisy estimate and the row cost an average, so a proposal that would only
/// break even is not made (traffic with nothing to copy then proposes next to nothing; a sequence
/// that copies expects 1.5-2x and is unaffected).
const MIN_GAIN: f32 = 1.1;
/// The weight of the latest observation in a sequence's acceptance estimate, and where the
/// estimate starts.
const ACCEPT_WEIGHT: f32 = 0.2;
const ACCEPT_START: f32 = 0.5;

/// One running choice's speculation state.
pub(super) struct SeqSpec {
    /// The sequence's tokens: its prompt (as far as this worker was sent it) and its output so
    /// far, the last one included.
    history: Vec<u32>,
    doc: Option<DocId>,
    /// The estimated chance that a proposed token is accepted.
    accept: f32,
    /// The first token proposed in a step that verified none: checked against the token chosen.
    shadow: Option<u32>,
    pub proposed: u64,
    pub accepted: u64,
}

impl SeqSpec {
    /// The estimated chance that a token proposed for this sequence is accepted.
    pub(super) fn accept(&self) -> f32 {
        self.accept
    }
}

/// The worker's speculation: its settings, the suffix index, and what a row costs here.
pub(super) struct Speculator {
    cfg: SpecConfig,
    index: Option<SuffixIndex>,
    /// Most rows a step may carry with proposals in it.
    row_budget: usize,
    /// A verifying step's cost, relative to a decode step.
    row_cost: RowCost,
    /// Time spent on speculation outside the forward pass since [`Speculator::take_spent`].
    spent: Duration,
}

impl Speculator {
    /// `row_budget`: rows a step may reach with proposals; `row_cost`: what rows cost (both the
    /// backend's).
    pub(super) fn new(cfg: SpecConfig, row_budget: usize, row_cost: RowCost) -> Self {
        let index = (cfg.mode == SpecMode::Suffix).then(|| SuffixIndex::new(SUFFIX_TOKENS, SUFFIX_ORDER));
        Speculator { cfg: SpecConfig { max_tokens: cfg.max_tokens.min(MAX_SPEC_TOKENS), ..cfg }, index, row_budget, row_cost, spent: Duration::ZERO }
    }

    /// The speculation of a worker serving `engine`: the budget and row cost of its backend. On
    /// the CPU, steps of up to `gemv_max_rows()` rows take the row-dot matmul, which computes each
    /// row as it would alone, at the measured `CPU_ROW_COST`. On a GPU a decode step is bound by
    /// reading the weights far beyond a few rows (the values are estimates: untested on a GPU).
    pub(super) fn for_engine(cfg: SpecConfig, engine: &ferry_engine::Engine) -> Self {
        let (budget, cost) = match engine.backend() {
            ferry_engine::DeviceBackend::Cpu(cpu) => (cpu.gemv_max_rows(), CPU_ROW_COST),
            // A GPU (the variant exists when the engine is built with CUDA).
            #[allow(unreachable_patterns)]
            _ => (GPU_ROW_BUDGET, GPU_ROW_COST),
        };
        Self::new(cfg, budget, cost)
    }

    pub(super) fn enabled(&self) -> bool {
        self.cfg.mode != SpecMode::Off && self.cfg.max_tokens > 0
    }

    /// K.
    pub(super) fn max_tokens(&self) -> usize {
        self.cfg.max_tokens
    }

    pub(super) fn row_budget(&self) -> usize {
        self.row_budget
    }

    /// A choice joins the batch: `context` is its prompt and its first token.
    pub(super) fn start(&mut self, context: &[u32]) -> Option<SeqSpec> {
        if !self.enabled() {
            return None;
        }
        let t = Instant::now();
        let doc = self.index.as_mut().map(|ix| {
            let d = ix.begin();
            ix.extend(d, context);
            d
        });
        let s = SeqSpec { history: context.to_vec(), doc, accept: ACCEPT_START, shadow: None, proposed: 0, accepted: 0 };
        self.spent += t.elapsed();
        Some(s)
    }

    /// Time spent on speculation outside the forward pass (choosing, learning, indexing, and
    /// what [`Speculator::charge`] adds) since the last call; the worker records it per step.
    pub(super) fn take_spent(&mut self) -> Duration {
        std::mem::take(&mut self.spent)
    }

    /// Time the worker spent on speculation's behalf (rolling back rejected proposals).
    pub(super) fn charge(&mut self, d: Duration) {
        self.spent += d;
    }

    /// How many tokens to propose for `s` now: the K that maximizes its expected tokens per unit
    /// of step time (see the module doc), at most `limit`.
    pub(super) fn wanted(&self, s: &SeqSpec, limit: usize) -> usize {
        let (mut best, mut best_rate) = (0, MIN_GAIN);
        let (mut gain, mut p) = (1.0f32, 1.0f32);
        for k in 1..=self.cfg.max_tokens.min(limit) {
            p *= s.accept;
            gain += p;
            let rate = gain / self.row_cost.of(k);
            if rate > best_rate {
                (best, best_rate) = (k, rate);
            }
        }
        best
    }

    /// Up to `k` proposed tokens for `s` into `out` (cleared first). With `k` = 0 one token is
    /// still proposed, not to verify but to check against the token chosen ([`Speculator::emitted`]).
    pub(super) fn propose(&mut self, s: &mut SeqSpec, k: usize, out: &mut Vec<u32>) {
        let t = Instant::now();
        out.clear();
        let want = k.max(1);
        match (self.cfg.mode, &self.index) {
            (SpecMode::Suffix, Some(ix)) => ix.propose(&s.history, SUFFIX_MIN_ORDER, SUFFIX_MIN_PROB, want, out),
            _ => ngram_propose(&s.history, NGRAM_MIN, NGRAM_MAX, want, out),
        }
        s.shadow = match k {
            0 => out.first().copied(),
            _ => None,
        };
        out.truncate(k);
        self.spent += t.elapsed();
    }

    /// `s` chose `tok` (emitted, or the stop token that ends it).
    pub(super) fn emitted(&mut self, s: &mut SeqSpec, tok: u32) {
        let t = Instant::now();
        if let Some(guess) = s.shadow.take() {
            observe(&mut s.accept, guess == tok);
        }
        s.history.push(tok);
        if let (Some(ix), Some(d)) = (self.index.as_mut(), s.doc) {
            ix.extend(d, &[tok]);
        }
        self.spent += t.elapsed();
    }

    /// A step verified `proposed` tokens of `s`, accepted the first `accepted`, and emitted
    /// `emitted` tokens in all (the accepted ones and the token chosen after them, unless the
    /// sequence ended first).
    pub(super) fn verified(&mut self, s: &mut SeqSpec, proposed: usize, accepted: usize, emitted: usize) {
        if proposed == 0 {
            return;
        }
        for _ in 0..accepted {
            observe(&mut s.accept, true);
        }
        if accepted < proposed {
            observe(&mut s.accept, false);
        }
        s.proposed += proposed as u64;
        s.accepted += accepted as u64;
        metrics::counter!(crate::cluster::metrics::names::SPEC_PROPOSED_TOKENS).increment(proposed as u64);
        metrics::counter!(crate::cluster::metrics::names::SPEC_ACCEPTED_TOKENS).increment(accepted as u64);
        metrics::counter!(crate::cluster::metrics::names::SPEC_VERIFY_STEPS).increment(1);
        metrics::counter!(crate::cluster::metrics::names::SPEC_EMITTED_TOKENS).increment(emitted as u64);
    }
}

fn observe(accept: &mut f32, hit: bool) {
    *accept += ACCEPT_WEIGHT * (f32::from(u8::from(hit)) - *accept);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(mode: SpecMode, linear: f32) -> Speculator {
        Speculator::new(SpecConfig { mode, max_tokens: 5 }, 12, RowCost { linear, square: 0.0 })
    }

    #[test]
    fn k_follows_the_acceptance_and_the_row_cost() {
        let mut sp = spec(SpecMode::Ngram, 0.1);
        let mut s = sp.start(&[1, 2, 3]).expect("on");
        s.accept = 0.95;
        assert_eq!(sp.wanted(&s, 99), 5, "a sequence that copies proposes all it may");
        assert_eq!(sp.wanted(&s, 2), 2, "the limit caps it");
        s.accept = 0.05;
        assert_eq!(sp.wanted(&s, 99), 0, "below the row cost, nothing is verified");
        let dear = spec(SpecMode::Ngram, 2.0);
        s.accept = 0.9;
        assert_eq!(dear.wanted(&s, 99), 0, "rows that cost more than they return are not spent");
        // The CPU's measured curve: rows cost more each as they grow.
        let cpu = Speculator::new(SpecConfig { mode: SpecMode::Ngram, max_tokens: 7 }, 12, CPU_ROW_COST);
        for (a, k) in [(0.95, 4), (0.9, 3), (0.5, 1), (0.15, 0)] {
            s.accept = a;
            assert_eq!(cpu.wanted(&s, 99), k, "acceptance {a}");
        }
    }

    #[test]
    fn acceptance_is_learned_from_verified_and_shadow_proposals() {
        let mut sp = spec(SpecMode::Ngram, 0.1);
        let mut s = sp.start(&[1, 2, 3, 1, 2]).expect("on");
        let mut out = Vec::new();
        // Nothing verified (k = 0): the first proposal is checked against what was chosen.
        sp.propose(&mut s, 0, &mut out);
        assert!(out.is_empty(), "k = 0 verifies nothing");
        let before = s.accept;
        sp.emitted(&mut s, 3);
        assert!(s.accept > before, "the shadow guess (3) was right");
        sp.propose(&mut s, 0, &mut out);
        let before = s.accept;
        sp.emitted(&mut s, 9);
        assert!(s.accept < before, "the shadow guess was wrong");
        let before = s.accept;
        sp.verified(&mut s, 4, 1, 2);
        assert_eq!((s.proposed, s.accepted), (4, 1));
        assert!(s.accept < before + 0.2 && s.accept != before);
    }

    #[test]
    fn the_time_spent_is_taken_once() {
        let mut sp = spec(SpecMode::Suffix, 0.1);
        let mut s = sp.start(&[1, 2, 3, 1, 2]).expect("on");
        let mut out = Vec::new();
        sp.propose(&mut s, 2, &mut out);
        sp.emitted(&mut s, 3);
        sp.charge(Duration::from_millis(5));
        assert!(sp.take_spent() > Duration::from_millis(5), "start, propose and emitted are clocked beside the charge");
        assert_eq!(sp.take_spent(), Duration::ZERO, "taken: the next step starts from zero");
    }

    #[test]
    fn proposals_come_from_the_sequence_and_from_earlier_ones() {
        let mut ng = spec(SpecMode::Ngram, 0.1);
        let mut s = ng.start(&[5, 6, 7, 8, 9, 5, 6]).expect("on");
        let mut out = Vec::new();
        ng.propose(&mut s, 3, &mut out);
        assert_eq!(out, [7, 8, 9], "prompt lookup continues the earlier 5 6");
        let mut sx = spec(SpecMode::Suffix, 0.1);
        let mut a = sx.start(&[40, 41, 42, 43, 44, 45]).expect("on");
        sx.emitted(&mut a, 46);
        let mut b = sx.start(&[1, 2, 42, 43]).expect("on");
        sx.propose(&mut b, 3, &mut out);
        assert_eq!(out, [44, 45, 46], "the suffix index continues what an earlier sequence did");
        assert!(spec(SpecMode::Off, 0.1).start(&[1, 2]).is_none(), "off: no state");
    }
}
