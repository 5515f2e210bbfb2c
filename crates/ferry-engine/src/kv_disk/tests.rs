use super::*;

fn identity() -> Identity {
    Identity { format: 1, fingerprint: "m".into(), kv_dtype: "f32".into(), block_size: 2, n_layers: 1, n_kv_heads: 1, head_dim: 4 }
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferry-kv-disk-unit-{}-{name}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    d
}

/// Offer the blocks of `tokens` (2 per block) under `root`, payload byte = the block's index.
fn offer_chain(t: &DiskTier, root: BlockHash, tokens: &[u32]) -> Vec<BlockHash> {
    let hashes = ferry_core::prefix_cache::block_hashes(root, tokens, 2);
    let mut parent = root;
    for (i, (&h, c)) in hashes.iter().zip(tokens.chunks(2)).enumerate() {
        assert!(t.reserve(h));
        t.offer(Write { hash: h, parent, tokens: c.to_vec(), payload: vec![i as u8; 16] });
        parent = h;
    }
    t.flush();
    hashes
}

#[test]
fn blocks_written_are_read_back_checked_and_found_again_after_reopening() {
    let dir = scratch("roundtrip");
    let cfg = DiskConfig { dir: dir.clone(), max_bytes: 1 << 20 };
    let root = BlockHash::root(b"m", b"");
    let tokens = [1, 2, 3, 4, 5, 6];
    let hashes = {
        let t = DiskTier::open(&cfg, &identity(), 16).unwrap();
        let hashes = offer_chain(&t, root, &tokens);
        assert!(!t.reserve(hashes[0]), "on disk: not copied out again");
        assert_eq!(t.chain(root, &tokens, usize::MAX), hashes);
        assert_eq!(t.read(hashes[1], hashes[0], &[3, 4]), Some(vec![1u8; 16]));
        // Asked for under the wrong chain: not served (and forgotten).
        assert_eq!(t.read(hashes[2], hashes[0], &[5, 6]), None);
        assert_eq!(t.chain(root, &tokens, usize::MAX), hashes[..2]);
        let ev = t.drain_events();
        assert_eq!(ev.iter().filter(|e| e.stored).count(), 3);
        assert_eq!(ev.last(), Some(&DiskEvent { stored: false, hash: hashes[2] }));
        let s = t.stats();
        assert_eq!((s.written_blocks, s.read_blocks, s.corrupt, s.blocks), (3, 1, 1, 2));
        hashes
    };
    let t = DiskTier::open(&cfg, &identity(), 16).unwrap();
    assert_eq!(t.stats().found_at_open, 2);
    assert_eq!(t.chain(root, &tokens, usize::MAX), hashes[..2]);
    let mut announced: Vec<BlockHash> = t.drain_events().into_iter().map(|e| e.hash).collect();
    announced.sort();
    let mut want = hashes[..2].to_vec();
    want.sort();
    assert_eq!(announced, want);
    drop(t);
    // Another payload size (another layout) finds the files unfit: deleted at open.
    let other = Identity { head_dim: 4, ..identity() };
    let t = DiskTier::open(&cfg, &other, 32).unwrap();
    assert_eq!((t.stats().blocks, t.stats().corrupt), (0, 2));
    drop(t);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn blocks_read_ahead_are_taken_from_memory_once() {
    let dir = scratch("prefetch");
    let cfg = DiskConfig { dir: dir.clone(), max_bytes: 1 << 20 };
    let root = BlockHash::root(b"m", b"");
    let tokens = [1, 2, 3, 4, 5, 6];
    let t = DiskTier::open(&cfg, &identity(), 16).unwrap();
    let hashes = offer_chain(&t, root, &tokens);
    // Block 2's file is damaged before it is read ahead: the read-ahead finds it a miss.
    let path = dir.join("blocks").join(format!("{:016x}.kvb", hashes[2].0));
    let mut bytes = fs::read(&path).unwrap();
    bytes[60] ^= 1;
    fs::write(&path, bytes).unwrap();
    t.prefetch(root, &tokens, &hashes);
    t.prefetch(root, &tokens, &hashes);
    assert_eq!(t.load(hashes[0], root, &[1, 2]), Some(vec![0u8; 16]));
    assert_eq!(t.load(hashes[1], hashes[0], &[3, 4]), Some(vec![1u8; 16]));
    assert_eq!(t.load(hashes[2], hashes[1], &[5, 6]), None);
    let s = t.stats();
    assert_eq!((s.read_blocks, s.corrupt), (2, 1), "each block read once, though asked for twice");
    // Taken: a second load reads the file again (it is still on disk).
    assert_eq!(t.load(hashes[0], root, &[1, 2]), Some(vec![0u8; 16]));
    assert_eq!(t.stats().read_blocks, 3);
    drop(t);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn an_int8_directory_of_the_unturned_layout_is_foreign() {
    let layout = ferry_core::KvLayout { dtype: ferry_core::KvDtype::Int8, block_size: 2, n_layers: 1, n_kv_heads: 1, head_dim: 4 };
    let now = Identity::new("m", &layout);
    assert_eq!(now.kv_dtype, "int8-hadamard");
    let before = Identity { kv_dtype: "int8".into(), ..now.clone() };
    assert_eq!(before.differs(&now).as_deref(), Some("KV dtype int8, this worker's int8-hadamard"));
}
