//! Prefix caching changes nothing but the work done: with the cache on, a prompt that starts with
//! cached blocks computes only its suffix, and the logits (within 1e-5) and greedy ids equal a
//! cache-off run on the golden models, for hits of none, part and all but the last block, with
//! prompts prefilled in chunks. A forced hash collision serves no wrong KV, the pool is whole after
//! release, and KV moved as a span onto a sequence holding the prefix decodes as a full import does.

mod common;
use common::*;
use ferry_engine::{Engine, EngineConfig, Logits, SeqId, StepItem};

const BS: usize = 4;
const TOL: f32 = 1e-5;

fn engine_with(dir: &std::path::Path, prefix_cache: bool, max_batch_tokens: usize, kv_tokens: usize) -> Engine {
    let cfg = EngineConfig { threads: 2, device: test_device(), block_size: BS, max_batch_tokens, kv_tokens: Some(kv_tokens), prefix_cache, ..Default::default() };
    Engine::load(dir, &cfg).expect("load model")
}

fn golden_prompt(name: &str) -> Vec<u32> {
    Tensors::open(golden_dir(name).join("golden.safetensors")).ids("input_ids")
}

/// The last prompt logits and `n` greedy decode steps (ids and the logits of each step), for a
/// sequence that holds the prompt's first `cached` tokens already.
fn run(e: &mut Engine, seq: SeqId, prompt: &[u32], cached: usize, n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut logits = vec![e.prefill(seq, &prompt[cached..]).expect("prefill")];
    let mut ids = vec![ferry_engine::sampler::argmax(&logits[0])];
    while ids.len() < n {
        let item = StepItem { seq, tokens: &ids[ids.len() - 1..], logits: Logits::Last };
        let l = e.step(&[item], &mut |_, _| {}).expect("decode step").pop().unwrap();
        ids.push(ferry_engine::sampler::argmax(&l));
        logits.push(l);
    }
    (ids, logits)
}

fn assert_pool_whole(e: &Engine) {
    assert_eq!(e.active_sequences(), 0);
    assert_eq!(e.used_blocks(), 0, "no block is referenced after every release");
    assert_eq!(e.free_blocks(), e.total_blocks(), "every block is free or cached");
    assert!(e.cached_blocks() <= e.free_blocks());
}

/// `prompt` with a cache-off engine and with a cache-on engine warmed by `donors` (prefilled and
/// released): the query sees `want_query` cached tokens, the cache-on run starts at `want_cached`
/// and gives the same logits and ids.
fn check_hit(name: &str, prompt: &[u32], donors: &[Vec<u32>], want: (usize, usize), max_batch_tokens: usize) {
    check_hit_at(&golden_dir(name), name, prompt, donors, want, max_batch_tokens, false, TOL)
}

/// With `split`, the cache-off run prefills the same split as the hit (the cached part, then the
/// rest), so only the cache differs. Logits must agree within `tol`.
#[allow(clippy::too_many_arguments)]
fn check_hit_at(dir: &std::path::Path, name: &str, prompt: &[u32], donors: &[Vec<u32>], (want_query, want_cached): (usize, usize), max_batch_tokens: usize, split: bool, tol: f32) {
    let dir = dir.to_path_buf();
    let mut off = engine_with(&dir, false, max_batch_tokens, 1024);
    let seq = off.new_sequence();
    let at = if split { want_cached } else { 0 };
    if at > 0 {
        off.prefill(seq, &prompt[..at]).unwrap();
    }
    let (want_ids, want_logits) = run(&mut off, seq, prompt, at, 8);
    off.release(seq).unwrap();
    assert_eq!(off.cached_blocks(), 0, "the cache is off");

    let mut on = engine_with(&dir, true, max_batch_tokens, 1024);
    for d in donors {
        let s = on.new_sequence();
        on.prefill(s, d).unwrap();
        on.release(s).unwrap();
    }
    assert_eq!(on.cached_prefix_len(prompt, &[]), want_query, "{name}: the query");
    let hits_before = on.cache_stats().hit_tokens;
    let (seq, cached) = on.new_sequence_from_cache(prompt, &[]).unwrap();
    assert_eq!(cached, want_cached, "{name}: cached tokens");
    assert_eq!(on.seq_len(seq).unwrap(), cached);
    assert_eq!(on.cache_stats().hit_tokens - hits_before, cached as u64);
    let (ids, logits) = run(&mut on, seq, prompt, cached, 8);
    assert_eq!(ids, want_ids, "{name}, {cached} cached: greedy ids differ from the cache-off run");
    for (i, (a, b)) in logits.iter().zip(&want_logits).enumerate() {
        let d = max_abs_diff(a, b);
        assert!(d <= tol, "{name}, {cached} cached: logits of step {i} differ by {d}");
    }
    on.release(seq).unwrap();
    assert_pool_whole(&on);
    assert!(on.cached_blocks() > 0, "released full blocks stay cached");
}

#[test]
fn cache_on_equals_cache_off_golden() {
    for name in GOLDEN_MODELS {
        let p = golden_prompt(name);
        assert_eq!(p.len(), 41, "the fixtures' prompt");
        let mut diverging = p.clone();
        diverging[10] = (p[10] + 1) % 64;
        for mbt in [2048, 6] {
            // No hit: nothing cached, or only a prompt that differs from the first block on.
            check_hit(name, &p, &[], (0, 0), mbt);
            let mut other = p.clone();
            other[0] = (p[0] + 1) % 64;
            check_hit(name, &p, &[other], (0, 0), mbt);
            // Part: a donor of 22 tokens leaves 5 full blocks; one diverging at token 10 leaves 2.
            check_hit(name, &p, &[p[..22].to_vec()], (20, 20), mbt);
            check_hit(name, &p, &[diverging.clone()], (8, 8), mbt);
            // All but the last block: 41 tokens = 10 full blocks + 1; 40 tokens leave their last
            // full block to compute (at least one token is computed for the logits).
            check_hit(name, &p, &[p.clone()], (40, 40), mbt);
            check_hit(name, &p[..40], &[p.clone()], (40, 36), mbt);
        }
    }
}

/// SmolLM2 (Q4_1 weights): a hit gives the logits of a cache-off run that prefills the same split
/// (bit for bit, in practice) and the greedy ids of one whole prefill. Against one whole prefill
/// its logits differ by ~3e-5: a 2-row step rounds differently from a 26-row one in this model's
/// matmul, with or without the cache, so that comparison is held to 1e-4.
#[test]
fn cache_on_equals_cache_off_smollm2() {
    let path = smollm2_path();
    let p = engine_with(&path, false, 2048, 256).encode("Once upon a time, in a village by the sea, there lived an old fisherman who told stories to the children every evening.").unwrap();
    assert!(p.len() > 24, "{} tokens", p.len());
    let full = p.len() / BS * BS;
    let last = if full == p.len() { full - BS } else { full };
    for (split, tol) in [(true, TOL), (false, 1e-4)] {
        check_hit_at(&path, "smollm2", &p, &[p[..22].to_vec()], (20, 20), 8, split, tol);
        check_hit_at(&path, "smollm2", &p, &[p.clone()], (full, last), 2048, split, tol);
    }
}

/// `generate` uses the cache, and still reproduces HF's greedy ids on a hit.
#[test]
fn generate_with_hits_matches_golden_ids() {
    for name in GOLDEN_MODELS {
        let dir = golden_dir(name);
        let g = Tensors::open(dir.join("golden.safetensors"));
        let (p, want) = (g.ids("input_ids"), g.ids("greedy_ids"));
        let mut e = engine_with(&dir, true, 16, 1024);
        assert_eq!(greedy(&mut e, &p, want.len()), want, "{name}: first run");
        assert_eq!(greedy(&mut e, &p, want.len()), want, "{name}: second run, prompt cached");
        // The second run hit the prompt's 10 full blocks, and the first run's generated tokens
        // filled and sealed more blocks: more is cached than the prompt's blocks.
        let s = e.cache_stats();
        assert_eq!((s.hits, s.hit_tokens), (1, 40), "{name}");
        assert!(e.cached_blocks() > 10, "{name}: {} cached", e.cached_blocks());
        assert_pool_whole(&e);
    }
}

#[test]
fn forced_hash_collision_serves_no_wrong_kv() {
    let name = "llama-gqa";
    let p = golden_prompt(name);
    let dir = golden_dir(name);
    let mut off = engine_with(&dir, false, 2048, 1024);
    let mut on = engine_with(&dir, true, 2048, 1024);
    on.set_prefix_hash_key_mask(0); // every block has the same index key
    // Cache a donor whose first block differs from the prompt's.
    let mut donor = p.clone();
    donor[1] = (p[1] + 1) % 64;
    let s = on.new_sequence();
    on.prefill(s, &donor).unwrap();
    on.release(s).unwrap();
    assert_eq!(on.cached_blocks(), 1, "one block holds the only key");
    // Every lookup for the prompt finds the donor's block under its key: a miss, never its KV.
    assert_eq!(on.cached_prefix_len(&p, &[]), 0);
    let (seq, cached) = on.new_sequence_from_cache(&p, &[]).unwrap();
    assert_eq!(cached, 0);
    assert_eq!(on.cache_stats().verify_misses, 1);
    let seq_off = off.new_sequence();
    let (want, want_logits) = run(&mut off, seq_off, &p, 0, 8);
    let (ids, logits) = run(&mut on, seq, &p, 0, 8);
    assert_eq!(ids, want);
    assert!(max_abs_diff(&logits[0], &want_logits[0]) <= TOL);
    on.release(seq).unwrap();
    // The donor's first block is a true hit for a prompt that starts the same way, and the
    // collision stops the walk right after it.
    let mut same_start = p.clone();
    same_start[..BS].copy_from_slice(&donor[..BS]);
    assert_eq!(on.cached_prefix_len(&same_start, &[]), BS);
    let (seq, cached) = on.new_sequence_from_cache(&same_start, &[]).unwrap();
    assert_eq!(cached, BS);
    let seq_off2 = off.new_sequence();
    let (want2, _) = run(&mut off, seq_off2, &same_start, 0, 8);
    assert_eq!(run(&mut on, seq, &same_start, cached, 8).0, want2);
    on.release(seq).unwrap();
    assert_pool_whole(&on);
}

#[test]
fn salts_separate_and_eviction_never_fails_an_allocation() {
    let name = "qwen2-bias-tied";
    let p = golden_prompt(name);
    // 12 blocks of 4: a 41-token prompt takes 11.
    let mut e = engine_with(&golden_dir(name), true, 2048, 48);
    assert_eq!(e.total_blocks(), 12);
    let s = e.new_sequence_salted(b"tenant-a");
    e.prefill(s, &p).unwrap();
    e.release(s).unwrap();
    assert_eq!(e.cached_blocks(), 10);
    assert_eq!(e.cached_prefix_len(&p, b"tenant-b"), 0, "another salt shares nothing");
    assert_eq!(e.cached_prefix_len(&p, &[]), 0, "nor does the empty salt");
    assert_eq!(e.cached_prefix_len(&p, b"tenant-a"), 40);
    let stored = e.drain_cache_events();
    assert_eq!(stored.len(), 10);
    assert!(stored.windows(2).all(|w| w[1].seq == w[0].seq + 1), "events are numbered in order");
    // A different prompt needs 11 blocks: 2 are empty, the other 9 are evicted, oldest first.
    let mut other = p.clone();
    other[0] = (p[0] + 1) % 64;
    let s = e.new_sequence();
    e.prefill(s, &other).expect("an allocation that fits without the cache succeeds");
    assert_eq!(e.cache_stats().evictions, 9);
    let evicted: Vec<_> = e.drain_cache_events().into_iter().filter(|ev| matches!(ev.kind, ferry_core::CacheEventKind::Evicted { .. })).collect();
    assert_eq!(evicted.len(), 9);
    assert_eq!(e.cached_blocks(), 1, "the first block of tenant-a's chain, the most recently used, survives");
    assert_eq!(e.cached_prefix_len(&p, b"tenant-a"), BS);
    e.release(s).unwrap();
    assert_pool_whole(&e);
}

fn continue_from(e: &mut Engine, seq: SeqId, first: u32, n: usize) -> Vec<u32> {
    continue_greedy(e, seq, first, n)
}

#[test]
fn span_import_onto_a_cached_prefix_decodes_as_a_full_import() {
    for name in GOLDEN_MODELS {
        let dir = golden_dir(name);
        let p = golden_prompt(name);
        // The prefill side: the whole prompt.
        let mut a = engine_with(&dir, true, 2048, 1024);
        let seq = a.new_sequence();
        let mut streamed = Vec::new();
        let logits = a
            .step(&[StepItem { seq, tokens: &p, logits: Logits::Last }], &mut |l, view| {
                let before = streamed.len();
                view.export_layer_from(seq, l, 20, &mut streamed).unwrap();
                let buf = view.export_layer_buffer_from(seq, l, 20).unwrap();
                if let Some(host) = buf.as_host() {
                    assert_eq!(host, &streamed[before..], "the buffer export holds the same section");
                }
            })
            .unwrap();
        let first = ferry_engine::sampler::argmax(&logits[0]);
        let full = a.export_kv(seq).unwrap();
        let span = a.export_kv_from(seq, 20).unwrap();
        assert_eq!(streamed, span[ferry_core::kv_payload::SPAN_HEADER_BYTES..].to_vec(), "layer-wise span export equals the span payload");
        assert_eq!(span.len() - ferry_core::kv_payload::SPAN_HEADER_BYTES, full.len() - ferry_core::kv_payload::HEADER_BYTES - 20 * a.kv_layout().n_layers * a.kv_layout().layer_bytes(1));
        assert!(a.export_kv_from(seq, 2).is_err(), "a span starts at a block boundary");
        a.release(seq).unwrap();

        // The decode side, reference: a full import.
        let mut b = engine_with(&dir, true, 2048, 1024);
        let s = b.import_kv(&full).unwrap();
        let want = continue_from(&mut b, s, first, 12);
        b.release(s).unwrap();

        // The decode side with the first 5 blocks cached (a 22-token prompt computed earlier).
        let mut c = engine_with(&dir, true, 2048, 1024);
        let d = c.new_sequence();
        c.prefill(d, &p[..22]).unwrap();
        c.release(d).unwrap();
        assert_eq!(c.cached_prefix_len(&p, &[]), 20);
        let (s, held) = c.new_sequence_with_prefix(&p, &[], usize::MAX);
        assert_eq!(held, 20);
        // A span that does not start where the sequence ends is refused, and changes nothing.
        let free = c.free_blocks();
        let other = c.new_sequence();
        assert!(c.import_kv_onto(other, &span, None).is_err());
        assert!(c.import_kv(&span).is_err(), "a whole-sequence import refuses a span");
        assert_eq!((c.free_blocks(), c.seq_len(other).unwrap()), (free, 0));
        c.release(other).unwrap();
        c.import_kv_onto(s, &span, Some(&p[20..])).unwrap();
        assert_eq!(c.seq_len(s).unwrap(), p.len());
        assert_eq!(continue_from(&mut c, s, first, 12), want, "{name}: decode after a span import");
        c.release(s).unwrap();
        // The span came with its token ids: the whole prompt's blocks are cached now.
        assert_eq!(c.cached_prefix_len(&p, &[]), 40);

        // The buffer path, onto a fresh hit of the same prefix.
        let (s, held) = c.new_sequence_with_prefix(&p[..22], &[], usize::MAX);
        assert_eq!(held, 20);
        let at = ferry_core::kv_payload::SPAN_HEADER_BYTES;
        let body = ferry_engine::KvBuffer::Host(span[at..].to_vec());
        c.import_kv_buffer_onto(s, &span[..at], &body, None).unwrap();
        assert_eq!(continue_from(&mut c, s, first, 12), want, "{name}: decode after a span buffer import");
        c.release(s).unwrap();
        assert_pool_whole(&c);

        // A whole import with its token ids caches like a computed prompt.
        let mut e = engine_with(&dir, true, 2048, 1024);
        let s = e.import_kv_with_tokens(&full, &p, &[]).unwrap();
        e.release(s).unwrap();
        assert_eq!(e.cached_prefix_len(&p, &[]), 40);
        assert!(e.import_kv_with_tokens(&full, &p[1..], &[]).is_err(), "token ids must match the payload");
        let body = ferry_engine::KvBuffer::Host(full[ferry_core::kv_payload::HEADER_BYTES..].to_vec());
        let s = e.import_kv_buffer_with_tokens(&full[..ferry_core::kv_payload::HEADER_BYTES], &body, &p, b"salted").unwrap();
        e.release(s).unwrap();
        assert_eq!(e.cached_prefix_len(&p, b"salted"), 40, "a buffer import with ids caches under its salt");
        assert_pool_whole(&e);
    }
}

