//! Batched prefill (several prompts in one forward) and batched decode (many sequences of
//! different lengths in one step) agree with running each sequence alone.

mod common;
use common::*;
use ferry_engine::{Engine, Logits, SeqId, StepItem};

fn prompts(e: &Engine) -> Vec<Vec<u32>> {
    ["Hello", "The quick brown fox jumps over the lazy dog, and then", "In 1969, humans first walked on the Moon. The mission was called", "Rust is a systems programming language that"]
        .iter()
        .map(|t| e.encode(t).unwrap())
        .collect()
}

/// `n` distinct prompts: the four above in turn, each ending in its own number.
fn numbered_prompts(e: &Engine, n: usize) -> Vec<Vec<u32>> {
    let base = prompts(e);
    (0..n).map(|i| [base[i % base.len()].clone(), e.encode(&format!(" number {i}")).unwrap()].concat()).collect()
}

fn alone(e: &mut Engine, prompt: &[u32], n: usize) -> (Vec<f32>, Vec<u32>) {
    let seq = e.new_sequence();
    let last = e.prefill(seq, prompt).unwrap();
    let toks = continue_greedy(e, seq, ferry_engine::sampler::argmax(&last), n);
    e.release(seq).unwrap();
    (last, toks)
}

fn check(model: &std::path::Path, tol: f32) {
    let mut e = engine(model);
    let ps = prompts(&e);
    let n = 12;
    let reference: Vec<_> = ps.iter().map(|p| alone(&mut e, p, n)).collect();

    // Batched prefill of all prompts in one step.
    let seqs: Vec<SeqId> = ps.iter().map(|_| e.new_sequence()).collect();
    let items: Vec<StepItem> = seqs.iter().zip(&ps).map(|(&seq, p)| StepItem { seq, tokens: p, logits: Logits::Last }).collect();
    let first = e.step(&items, &mut |_, _| {}).unwrap();
    let mut toks: Vec<Vec<u32>> = Vec::new();
    for (i, l) in first.iter().enumerate() {
        let d = max_abs_diff(l, &reference[i].0);
        assert!(d <= tol, "prompt {i}: batched prefill logits differ by {d}");
        toks.push(vec![ferry_engine::sampler::argmax(l)]);
    }
    // Batched decode; sequences have different lengths, and one leaves early (continuous batching).
    for step in 1..n {
        let active: Vec<usize> = (0..seqs.len()).filter(|&i| !(i == 0 && step > n / 2)).collect();
        let last: Vec<u32> = active.iter().map(|&i| *toks[i].last().unwrap()).collect();
        let items: Vec<StepItem> = active.iter().zip(&last).map(|(&i, t)| StepItem { seq: seqs[i], tokens: std::slice::from_ref(t), logits: Logits::Last }).collect();
        let out = e.step(&items, &mut |_, _| {}).unwrap();
        for (&i, l) in active.iter().zip(&out) {
            toks[i].push(ferry_engine::sampler::argmax(l));
        }
    }
    for (i, t) in toks.iter().enumerate() {
        let want = &reference[i].1[..t.len()];
        assert_eq!(t, want, "sequence {i}: batched greedy tokens differ");
    }
    for s in seqs {
        e.release(s).unwrap();
    }
    assert_eq!(e.free_blocks(), e.total_blocks());
}

#[test]
fn batched_equals_alone_golden() {
    for name in GOLDEN_MODELS {
        check(&golden_dir(name), 1e-4);
    }
}

#[test]
fn batched_equals_alone_smollm2() {
    check(&smollm2_path(), 1e-3);
}

#[test]
fn mixed_step_prefill_and_decode_together() {
    // A decode token of one sequence and a prefill chunk of another in the same forward pass.
    let mut e = engine(&smollm2_path());
    let ps = prompts(&e);
    let (_, ref_a) = alone(&mut e, &ps[1], 3);
    let (ref_b_logits, _) = alone(&mut e, &ps[2], 1);
    let a = e.new_sequence();
    let first = e.prefill(a, &ps[1]).unwrap();
    let t0 = ferry_engine::sampler::argmax(&first);
    let b = e.new_sequence();
    let out = e
        .step(&[StepItem { seq: a, tokens: &[t0], logits: Logits::Last }, StepItem { seq: b, tokens: &ps[2], logits: Logits::Last }], &mut |_, _| {})
        .unwrap();
    assert_eq!(ferry_engine::sampler::argmax(&out[0]), ref_a[1]);
    assert!(max_abs_diff(&out[1], &ref_b_logits) <= 1e-3);
    e.release(a).unwrap();
    e.release(b).unwrap();
}

/// The logits of each sequence's next decode step (token `next[i]`) taken alone, on a copy of its
/// KV (export → import), the sequence itself left as it was.
fn each_alone(e: &mut Engine, seqs: &[SeqId], next: &[u32]) -> Vec<Vec<f32>> {
    seqs.iter()
        .zip(next)
        .map(|(&s, &t)| {
            let copy = e.import_kv(&e.export_kv(s).unwrap()).unwrap();
            let logits = e.step(&[StepItem { seq: copy, tokens: &[t], logits: Logits::Last }], &mut |_, _| {}).unwrap().remove(0);
            e.release(copy).unwrap();
            logits
        })
        .collect()
}

#[test]
fn decode_batches_either_side_of_the_matmul_switch_equal_alone() {
    // A decode step of `GEMV_MAX_ROWS` rows takes the CPU matmul's row-dot path, one more row its
    // dequantize + GEMM path: each sequence's logits in either equal its own step alone.
    let switch = ferry_engine::backend::cpu::GEMV_MAX_ROWS;
    let mut e = engine(&smollm2_path());
    let ps = numbered_prompts(&e, switch + 1);
    let seqs: Vec<SeqId> = ps.iter().map(|_| e.new_sequence()).collect();
    let next: Vec<u32> = seqs.iter().zip(&ps).map(|(&s, p)| ferry_engine::sampler::argmax(&e.prefill(s, p).unwrap())).collect();
    let alone = each_alone(&mut e, &seqs, &next);
    let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
    for rows in [switch, switch + 1] {
        let copies: Vec<SeqId> = seqs[..rows].iter().map(|&s| e.import_kv(&e.export_kv(s).unwrap()).unwrap()).collect();
        let items: Vec<StepItem> = copies.iter().zip(&toks).map(|(&seq, t)| StepItem { seq, tokens: t, logits: Logits::Last }).collect();
        let batched = e.step(&items, &mut |_, _| {}).unwrap();
        for (i, (a, b)) in alone.iter().zip(&batched).enumerate() {
            let d = max_abs_diff(a, b);
            assert!(d <= 1e-3, "{rows} rows: sequence {i}'s batched decode logits differ from alone by {d}");
        }
        for c in copies {
            e.release(c).unwrap();
        }
    }
    for s in seqs {
        e.release(s).unwrap();
    }
    assert_eq!(e.free_blocks(), e.total_blocks());
}

#[test]
fn q8_decode_is_batch_invariant() {
    // With 8-bit activations, decode rows run the interleaved kernels, whose result for one
    // sequence does not depend on the others in the step: batched decode logits are bit for bit
    // those of the sequence alone. That holds only up to the row-dot path's `gemv_max_rows()`
    // rows (`Q8_GEMV_MAX_ROWS`: every SmolLM2 matrix has an interleaved copy), the batch tested
    // here: a longer step takes the GEMM path with exact f32 activations, so its logits are not
    // the q8 ones a sequence gets alone (docs/architecture.md and docs/benchmarks.md state this
    // limit).
    let cfg = ferry_engine::EngineConfig { threads: 2, activations: ferry_engine::Activations::Q8, ..Default::default() };
    let mut e = Engine::load(&smollm2_path(), &cfg).unwrap();
    let rows = match e.backend() {
        ferry_engine::DeviceBackend::Cpu(cpu) => cpu.gemv_max_rows(),
        #[allow(unreachable_patterns)]
        _ => unreachable!("a CPU engine"),
    };
    assert_eq!(rows, ferry_engine::backend::cpu::Q8_GEMV_MAX_ROWS, "every SmolLM2 matrix has an interleaved copy");
    let ps = numbered_prompts(&e, rows);
    let seqs: Vec<SeqId> = ps.iter().map(|_| e.new_sequence()).collect();
    let mut next: Vec<u32> = seqs.iter().zip(&ps).map(|(&s, p)| ferry_engine::sampler::argmax(&e.prefill(s, p).unwrap())).collect();
    for _ in 0..4 {
        // Each sequence alone, then all of them together.
        let alone = each_alone(&mut e, &seqs, &next);
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let items: Vec<StepItem> = seqs.iter().zip(&toks).map(|(&seq, t)| StepItem { seq, tokens: t, logits: Logits::Last }).collect();
        let batched = e.step(&items, &mut |_, _| {}).unwrap();
        for (i, (a, b)) in alone.iter().zip(&batched).enumerate() {
            let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "sequence {i}: batched q8 decode logits differ from alone by up to {}", max_abs_diff(a, b));
        }
        next = batched.iter().map(|l| ferry_engine::sampler::argmax(l)).collect();
    }
    for s in seqs {
        e.release(s).unwrap();
    }
}
