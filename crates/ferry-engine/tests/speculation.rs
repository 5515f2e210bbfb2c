//! What speculative decoding needs of the engine: a sequence's step over `[last, d1..dk]` with
//! every row's logits (verification), whose rows are computed exactly as the decode steps they
//! replace, bit for bit; and `Engine::truncate`, which rolls back the proposed tokens that were
//! not accepted, across block boundaries, leaking nothing and leaving the cache correct.

mod common;
use common::*;
use ferry_engine::{Activations, Engine, EngineConfig, Logits, SeqId, StepItem};

fn load(activations: Activations, block_size: usize) -> Engine {
    let cfg = EngineConfig { threads: 2, device: test_device(), activations, block_size, ..Default::default() };
    Engine::load(&smollm2_path(), &cfg).expect("load model")
}

fn prompt(e: &Engine) -> Vec<u32> {
    e.encode("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the").unwrap()
}

/// Plain greedy decoding: each step's logits and the token chosen from them (`n` steps).
fn plain(e: &mut Engine, prompt: &[u32], n: usize) -> Vec<(Vec<f32>, u32)> {
    let seq = e.new_sequence();
    let mut logits = e.prefill(seq, prompt).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let tok = ferry_engine::sampler::argmax(&logits);
        out.push((logits, tok));
        logits = e.step(&[StepItem { seq, tokens: &[tok], logits: Logits::Last }], &mut |_, _| {}).unwrap().remove(0);
    }
    e.release(seq).unwrap();
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Greedy decoding by verification: each step feeds the last token and up to `k` proposals from
/// `propose(position, truth)`, keeps the proposals the logits agree with, truncates the rest.
/// Every row is checked against `reference` as it goes: bit for bit (`exact_bits`), else within
/// 1e-3; the emitted tokens must be `reference`'s.
fn speculative(e: &mut Engine, prompt: &[u32], reference: &[(Vec<f32>, u32)], k: usize, exact_bits: bool, what: &str, propose: &dyn Fn(usize, &[u32]) -> Vec<u32>) {
    let truth: Vec<u32> = reference.iter().map(|r| r.1).collect();
    let seq = e.new_sequence();
    let first = e.prefill(seq, prompt).unwrap();
    assert!(bits(&first) == bits(&reference[0].0), "prefill logits");
    let mut emitted = vec![ferry_engine::sampler::argmax(&first)];
    while emitted.len() < reference.len() {
        let pos = emitted.len();
        let mut drafts = propose(pos, &truth);
        drafts.truncate(k.min(reference.len() - pos - 1));
        let tokens: Vec<u32> = std::iter::once(emitted[pos - 1]).chain(drafts.iter().copied()).collect();
        let held = e.seq_len(seq).unwrap();
        let rows = e.step(&[StepItem { seq, tokens: &tokens, logits: Logits::All }], &mut |_, _| {}).unwrap().remove(0);
        let vocab = rows.len() / tokens.len();
        let mut accepted = 0;
        for (j, row) in rows.chunks(vocab).enumerate() {
            let at = pos + j;
            let (want, d) = (&reference[at].0, max_abs_diff(row, &reference[at].0));
            let same = match exact_bits {
                true => bits(row) == bits(want),
                false => d <= 1e-3,
            };
            assert!(same, "{what} proposals, k={k}: row {j} of the step at token {pos} differs from plain decoding by up to {d}");
            let tok = ferry_engine::sampler::argmax(row);
            emitted.push(tok);
            if emitted.len() == reference.len() || j == drafts.len() || drafts[j] != tok {
                break;
            }
            accepted += 1;
        }
        // The cache holds the last token and the accepted proposals; the rest is rolled back.
        e.truncate(seq, held + 1 + accepted).unwrap();
        assert_eq!(e.seq_len(seq).unwrap(), held + 1 + accepted);
    }
    assert_eq!(emitted, truth, "{what} proposals, k={k}: speculative greedy output");
    e.release(seq).unwrap();
}

#[test]
fn verified_rows_are_decode_rows_bit_for_bit_and_rollback_is_exact() {
    // Right proposals (all accepted), wrong ones (all rejected), and half right, for both
    // activation modes, with a small block size so that proposals cross block boundaries and
    // fill blocks (sealed with rejected tokens) that the rollback must replace with a copy.
    // With q8 activations (the serving default) a step of a few rows computes each row as it
    // would alone, bit for bit; the exact mode's row-dot kernel sums in an order that depends on
    // the rows in the step (as its batched decode does: tests/batching.rs), within 1e-3.
    for (activations, bitwise) in [(Activations::Q8, true), (Activations::Exact, false)] {
        let mut e = load(activations, 4);
        let p = prompt(&e);
        let reference = plain(&mut e, &p, 40);
        let vocab = e.config().vocab_size as u32;
        for k in [1, 4, 7] {
            speculative(&mut e, &p, &reference, k, bitwise, &format!("{activations:?}, right"), &|pos, truth| truth[pos..].iter().take(k).copied().collect());
            speculative(&mut e, &p, &reference, k, bitwise, &format!("{activations:?}, wrong"), &|pos, truth| truth[pos..].iter().take(k).map(|&t| (t + 1) % vocab).collect());
            speculative(&mut e, &p, &reference, k, bitwise, &format!("{activations:?}, half-right"), &|pos, truth| truth[pos..].iter().take(k).enumerate().map(|(i, &t)| if i == k / 2 { (t + 7) % vocab } else { t }).collect());
        }
        assert_eq!(e.used_blocks(), 0, "{activations:?}: every block came back");
    }
}

#[test]
fn truncate_keeps_what_it_must_and_frees_the_rest() {
    let mut e = load(Activations::Exact, 4);
    let total = e.total_blocks();
    let p = prompt(&e);
    let seq = e.new_sequence();
    e.prefill(seq, &p).unwrap();
    let n = e.seq_len(seq).unwrap();
    // Nothing to cut; too much to cut.
    e.truncate(seq, n).unwrap();
    assert!(e.truncate(seq, n + 1).is_err(), "truncating past the end is refused");
    assert!(e.truncate(SeqId(9999), 0).is_err(), "an unknown sequence is refused");
    assert_eq!(e.seq_len(seq).unwrap(), n);
    // Append 9 tokens (two more full blocks, sealed), then cut into the first of them: one
    // block for the kept rows (a copy), none past it.
    let extra: Vec<u32> = p[..9].to_vec();
    e.step(&[StepItem { seq, tokens: &extra, logits: Logits::None }], &mut |_, _| {}).unwrap();
    let before = e.free_blocks();
    e.truncate(seq, n + 2).unwrap();
    assert_eq!(e.seq_len(seq).unwrap(), n + 2);
    let held = (n + 2).div_ceil(4);
    assert_eq!(e.used_blocks(), held, "blocks held after the cut");
    assert!(e.free_blocks() > before, "the cut freed blocks");
    // The sequence continues as if the cut tokens had never been there.
    let next = e.step(&[StepItem { seq, tokens: &p[2..3], logits: Logits::Last }], &mut |_, _| {}).unwrap().remove(0);
    let fresh = e.new_sequence();
    let want = e.prefill(fresh, &[p.clone(), p[..2].to_vec(), p[2..3].to_vec()].concat()).unwrap();
    assert!(max_abs_diff(&next, &want) <= 1e-3, "logits after the cut differ from computing the kept tokens afresh");
    e.release(fresh).unwrap();
    e.release(seq).unwrap();
    assert_eq!(e.used_blocks(), 0);
    assert_eq!(e.free_blocks(), total);
}
