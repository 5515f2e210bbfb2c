//! The KV disk tier (issue 38) changes nothing but the work done: a prefix evicted from the pool
//! is read back from disk and gives the logits a cache-off run gives (within 1e-5, the prefix
//! cache's own bound), across a restart of the engine on the same directory too. A damaged file is
//! a miss (deleted, counted), never served; a directory in use, or of another model or layout,
//! is refused by name; the tier stays within its size.

mod common;
use common::*;
use ferry_engine::kv_disk::DiskConfig;
use ferry_core::KvDtype;
use ferry_engine::{Engine, EngineConfig};

const BS: usize = 4;
const TOL: f32 = 1e-5;
const MODEL: &str = "llama-gqa";

fn config(disk: &std::path::Path, kv_tokens: usize, max_bytes: u64) -> EngineConfig {
    EngineConfig {
        threads: 2,
        device: test_device(),
        block_size: BS,
        kv_tokens: Some(kv_tokens),
        kv_disk: Some(DiskConfig { dir: disk.to_path_buf(), max_bytes }),
        ..Default::default()
    }
}

fn load(disk: &std::path::Path, kv_tokens: usize) -> Engine {
    Engine::load(&golden_dir(MODEL), &config(disk, kv_tokens, 1 << 30)).expect("load with a disk tier")
}

fn prompt() -> Vec<u32> {
    Tensors::open(golden_dir(MODEL).join("golden.safetensors")).ids("input_ids")
}

/// The logits of `p` with the first `at` tokens prefilled apart (the split a hit of `at` makes),
/// on an engine without any cache.
fn reference(p: &[u32], at: usize) -> Vec<f32> {
    let cfg = EngineConfig { threads: 2, device: test_device(), block_size: BS, kv_tokens: Some(256), prefix_cache: false, ..Default::default() };
    let mut e = Engine::load(&golden_dir(MODEL), &cfg).unwrap();
    let seq = e.new_sequence();
    if at > 0 {
        e.prefill(seq, &p[..at]).unwrap();
    }
    let l = e.prefill(seq, &p[at..]).unwrap();
    e.release(seq).unwrap();
    l
}

/// Start `p` on whatever is cached (pool, then disk) and return the tokens served from cache and
/// the last logits.
fn serve(e: &mut Engine, p: &[u32]) -> (usize, Vec<f32>) {
    let (seq, cached) = e.new_sequence_from_cache(p, b"").unwrap();
    let l = e.prefill(seq, &p[cached..]).unwrap();
    e.release(seq).unwrap();
    (cached, l)
}

/// Fill the pool with another prompt's blocks, evicting every cached block of the first.
fn evict_with_other(e: &mut Engine, len: usize) {
    let other: Vec<u32> = (0..len as u32).map(|i| (i * 7 + 3) % 60 + 1).collect();
    let seq = e.new_sequence();
    e.prefill(seq, &other).unwrap();
    e.release(seq).unwrap();
}

#[test]
fn a_prefix_evicted_from_the_pool_is_read_back_and_survives_a_restart() {
    let p = prompt();
    assert_eq!(p.len(), 41, "the fixtures' prompt: 10 full blocks and one token");
    let want = reference(&p, 40);
    let dir = ScratchDir::new("kv-disk");
    {
        // A pool of 12 blocks: the prompt's 11, then another prompt's 11, evicts the first.
        let mut e = load(&dir, 48);
        let (cached, _) = serve(&mut e, &p);
        assert_eq!(cached, 0);
        e.kv_disk().unwrap().flush();
        assert_eq!(e.kv_disk().unwrap().stats().blocks, 10, "every full block written through");
        evict_with_other(&mut e, 44);
        e.kv_disk().unwrap().flush();
        assert_eq!(e.cached_prefix_len(&p, b""), 40, "from disk, the pool holding none of it");
        let (cached, got) = serve(&mut e, &p);
        assert_eq!(cached, 40);
        assert!(max_abs_diff(&got, &want) <= TOL, "{}", max_abs_diff(&got, &want));
        let s = e.kv_disk().unwrap().stats();
        assert!(s.read_blocks >= 1 && s.corrupt == 0, "{s:?}");
        assert_eq!(e.disk_hit_tokens(), s.read_blocks * BS as u64);
        // What was read back is in the pool again: a second hit reads nothing more.
        let (cached, _) = serve(&mut e, &p);
        assert_eq!((cached, e.kv_disk().unwrap().stats().read_blocks), (40, s.read_blocks));
        let events = e.drain_disk_events();
        assert!(events.iter().filter(|ev| ev.stored).count() >= 10, "{events:?}");
    }
    // A new engine on the same directory: the blocks are found, announced and served.
    let mut e = load(&dir, 48);
    let s = e.kv_disk().unwrap().stats();
    assert!(s.found_at_open >= 10, "{s:?}");
    let announced = e.drain_disk_events();
    assert_eq!(announced.len() as u64, s.found_at_open);
    assert_eq!(e.cached_prefix_len(&p, b""), 40);
    let (cached, got) = serve(&mut e, &p);
    assert_eq!(cached, 40);
    assert!(max_abs_diff(&got, &want) <= TOL, "{}", max_abs_diff(&got, &want));
    // Another salt (another tenant) reaches none of it.
    assert_eq!(e.cached_prefix_len(&p, b"tenant"), 0);
}

#[test]
fn a_damaged_block_file_is_a_miss_never_served() {
    let p = prompt();
    let dir = ScratchDir::new("kv-disk-damaged");
    {
        let mut e = load(&dir, 48);
        serve(&mut e, &p);
        e.kv_disk().unwrap().flush();
    }
    // Block 5 of the chain: one byte of its KV flipped. Block 7: cut short.
    let chain = ferry_core::prefix_cache::block_hashes(ferry_core::BlockHash::cache_root(load_fingerprint(&dir).as_bytes(), KvDtype::F32, b""), &p, BS);
    let file = |i: usize| dir.join("blocks").join(format!("{:016x}.kvb", chain[i].0));
    let mut damaged = std::fs::read(file(5)).unwrap();
    let mid = damaged.len() / 2;
    damaged[mid] ^= 1;
    std::fs::write(file(5), &damaged).unwrap();
    let bytes = std::fs::read(file(7)).unwrap();
    std::fs::write(file(7), &bytes[..bytes.len() - 9]).unwrap();
    let mut e = load(&dir, 48);
    // The cut file fails its header check at open; the flipped one passes it, and fails on read.
    assert_eq!(e.kv_disk().unwrap().stats().corrupt, 1);
    assert!(!file(7).exists());
    let (cached, got) = serve(&mut e, &p);
    assert_eq!(cached, 20, "blocks 0-4 served, block 5 a miss");
    assert_eq!(e.kv_disk().unwrap().stats().corrupt, 2);
    let want = reference(&p, 20);
    assert!(max_abs_diff(&got, &want) <= TOL, "{}", max_abs_diff(&got, &want));
    // The damaged file was deleted; the blocks computed again in its place are written anew.
    e.kv_disk().unwrap().flush();
    assert_ne!(std::fs::read(file(5)).ok(), Some(damaged), "the damaged file is gone");
    drop(e);
    let mut e = load(&dir, 48);
    let (cached, got) = serve(&mut e, &p);
    assert_eq!((cached, e.kv_disk().unwrap().stats().corrupt), (40, 0), "whole again from disk");
    assert!(max_abs_diff(&got, &reference(&p, 40)) <= TOL);
}

/// The fingerprint the tier records for the model (its manifest).
fn load_fingerprint(dir: &std::path::Path) -> String {
    let m: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    m["fingerprint"].as_str().unwrap().to_string()
}

#[test]
fn a_directory_in_use_or_of_another_layout_is_refused() {
    let dir = ScratchDir::new("kv-disk-refused");
    let first = load(&dir, 48);
    let err = Engine::load(&golden_dir(MODEL), &config(&dir, 48, 1 << 30)).err().expect("a second engine on the same directory");
    assert!(err.to_string().contains("in use by another worker"), "{err}");
    drop(first);
    let bf16 = EngineConfig { kv_dtype: KvDtype::BF16, ..config(&dir, 48, 1 << 30) };
    let err = Engine::load(&golden_dir(MODEL), &bf16).err().expect("another KV dtype");
    assert!(err.to_string().contains("KV dtype f32, this worker's bf16"), "{err}");
    let other = EngineConfig { block_size: 8, ..config(&dir, 48, 1 << 30) };
    let err = Engine::load(&golden_dir(MODEL), &other).err().expect("another block size");
    assert!(err.to_string().contains("block size 4, this worker's 8"), "{err}");
    let off = EngineConfig { prefix_cache: false, ..config(&dir, 48, 1 << 30) };
    assert!(Engine::load(&golden_dir(MODEL), &off).is_err(), "a disk tier without the prefix cache");
}

#[test]
fn the_tier_stays_within_its_size() {
    let p = prompt();
    let dir = ScratchDir::new("kv-disk-small");
    let probe = load(&dir, 48);
    let block_file = probe.kv_disk().unwrap().payload_bytes() as u64 + 200;
    drop(probe);
    // Room for 4 blocks' files: of the prompt's 10 blocks, at most 4 stay.
    let mut e = Engine::load(&golden_dir(MODEL), &config(&dir, 48, 4 * block_file)).unwrap();
    serve(&mut e, &p);
    e.kv_disk().unwrap().flush();
    let s = e.kv_disk().unwrap().stats();
    assert!(s.blocks <= 4 && s.bytes <= s.capacity_bytes && s.evicted >= 6, "{s:?}");
    let files = std::fs::read_dir(dir.join("blocks")).unwrap().count() as u64;
    assert_eq!(files, s.blocks, "evicted blocks' files are deleted");
}

#[test]
fn a_prefix_read_ahead_is_served_from_memory_with_each_block_read_once() {
    let p = prompt();
    let want = reference(&p, 40);
    let dir = ScratchDir::new("kv-disk-ahead");
    let mut e = load(&dir, 48);
    serve(&mut e, &p);
    e.kv_disk().unwrap().flush();
    evict_with_other(&mut e, 44);
    e.kv_disk().unwrap().flush();
    let before = e.kv_disk().unwrap().stats().read_blocks;
    // What a decode worker's attach does: ask for the read, step others until it is over, start.
    let ahead = e.prefetch_prefix(&p, b"");
    let t0 = std::time::Instant::now();
    while !e.prefetched(&ahead, std::time::Duration::ZERO) {
        assert!(t0.elapsed() < std::time::Duration::from_secs(20), "the read ahead never ended");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    // The blocks the pool lost (all of the prompt's 10 but what the other prompt left cached).
    let read = e.kv_disk().unwrap().stats().read_blocks - before;
    assert!((1..=10).contains(&read), "the reader read {read} blocks");
    let (cached, got) = serve(&mut e, &p);
    assert_eq!(cached, 40);
    assert!(max_abs_diff(&got, &want) <= TOL, "{}", max_abs_diff(&got, &want));
    assert_eq!(e.kv_disk().unwrap().stats().read_blocks - before, read, "starting read nothing more");
    assert_eq!(e.disk_hit_tokens(), read * BS as u64);
    // A prefix the pool holds whole has nothing to read: over at once.
    let held = e.prefetch_prefix(&p, b"");
    assert!(e.prefetched(&held, std::time::Duration::ZERO));
}
