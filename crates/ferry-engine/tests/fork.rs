//! A forked sequence (one more choice of an `n`-choice request) is the same KV as its parent:
//! on the golden models, every fork of a prompt decodes what a fresh prefill of the prompt does
//! (logits within 1e-5), forks that then take different tokens stay independent (writing into one
//! fork's copy of the partial block leaves the others' untouched), full blocks are shared rather
//! than copied, and the pool is whole after all are released, with the prefix cache on and off.

mod common;
use common::*;
use ferry_engine::{Engine, EngineConfig, Logits, SeqId, StepItem};

const BS: usize = 4;
const TOL: f32 = 1e-5;

fn engine_with(dir: &std::path::Path, prefix_cache: bool) -> Engine {
    let cfg = EngineConfig { threads: 2, device: test_device(), block_size: BS, kv_tokens: Some(512), prefix_cache, ..Default::default() };
    Engine::load(dir, &cfg).expect("load model")
}

fn decode(e: &mut Engine, seq: SeqId, tokens: &[u32]) -> Vec<Vec<f32>> {
    tokens
        .iter()
        .map(|t| e.step(&[StepItem { seq, tokens: std::slice::from_ref(t), logits: Logits::Last }], &mut |_, _| {}).expect("decode step").pop().unwrap())
        .collect()
}

/// Reference: a fresh sequence with `prompt` prefilled, then `tokens` decoded one by one.
fn fresh(e: &mut Engine, prompt: &[u32], tokens: &[u32]) -> (Vec<f32>, Vec<Vec<f32>>) {
    let seq = e.new_sequence();
    let last = e.prefill(seq, prompt).expect("prefill");
    let steps = decode(e, seq, tokens);
    e.release(seq).unwrap();
    (last, steps)
}

fn check(name: &str, prefix_cache: bool) {
    let mut e = engine_with(&golden_dir(name), prefix_cache);
    let full = Tensors::open(golden_dir(name).join("golden.safetensors")).ids("input_ids");
    // A prompt ending inside a block (a copy is made) and one of whole blocks (nothing to copy).
    for len in [4 * BS + 3, 4 * BS] {
        let prompt = &full[..len];
        let free = e.free_blocks();
        let parent = e.new_sequence();
        let last = e.prefill(parent, prompt).unwrap();
        let before = e.free_blocks();
        let forks: Vec<SeqId> = (0..2).map(|_| e.fork(parent).unwrap()).collect();
        let copies = usize::from(len % BS != 0);
        assert_eq!(before - e.free_blocks(), 2 * copies, "{name} len {len}: only the partial block is copied");
        // Three different continuations, one per sequence, interleaved step by step.
        let first = ferry_engine::sampler::argmax(&last);
        let conts: Vec<Vec<u32>> = (0..3u32).map(|k| (0..5).map(|j| (first + 7 * k + j) % 500).collect()).collect();
        let seqs = [parent, forks[0], forks[1]];
        let mut got: Vec<Vec<Vec<f32>>> = vec![Vec::new(); 3];
        for j in 0..5 {
            let toks: Vec<[u32; 1]> = conts.iter().map(|c| [c[j]]).collect();
            let items: Vec<StepItem> = seqs.iter().zip(&toks).map(|(&seq, t)| StepItem { seq, tokens: t, logits: Logits::Last }).collect();
            for (k, l) in e.step(&items, &mut |_, _| {}).unwrap().into_iter().enumerate() {
                got[k].push(l);
            }
        }
        for (k, c) in conts.iter().enumerate() {
            let (want_last, want) = fresh(&mut e, prompt, c);
            assert!(max_abs_diff(&last, &want_last) <= TOL);
            for (j, (g, w)) in got[k].iter().zip(&want).enumerate() {
                let d = max_abs_diff(g, w);
                assert!(d <= TOL, "{name} len {len} sequence {k} step {j}: logits differ by {d} from a fresh prefill");
            }
        }
        for s in seqs {
            e.release(s).unwrap();
        }
        if !prefix_cache {
            assert_eq!(e.free_blocks(), free, "{name} len {len}: blocks leaked");
        }
    }
    if prefix_cache {
        // Cached blocks count as free: the pool is whole.
        assert_eq!(e.free_blocks(), e.total_blocks());
        assert_eq!(e.used_blocks(), 0);
    }
    assert!(e.fork(SeqId(u64::MAX)).is_err(), "an unknown sequence is an error");
}

#[test]
fn forks_decode_as_fresh_prefills_golden() {
    for name in ["llama-gqa", "qwen2-bias-tied"] {
        for cache in [false, true] {
            check(name, cache);
        }
    }
}
