//! Property tests of [`crate::BlockPool`] with the prefix cache: random sequences of prompts
//! (attach the cached prefix, allocate the rest, seal the full blocks) and releases, checked
//! after every step against a model of what the pool must hold.

use crate::prefix_cache::{BlockHash, CacheEventKind, Parent};
use crate::{BlockId, BlockPool, BlockTable, PoolError};
use proptest::prelude::*;
use std::collections::{HashMap, HashSet};

const BS: usize = 2;

#[derive(Clone, Debug)]
enum Op {
    /// A prompt (tokens from a tiny vocabulary, so prefixes repeat) under salt 0 or 1.
    Start { prompt: Vec<u32>, salt: u8 },
    /// Release the live sequence at this index (modulo their number).
    Release(usize),
    /// Release a block no one holds: must fail and change nothing.
    ReleaseUnheld,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (proptest::collection::vec(0u32..3, 1..9), 0u8..2).prop_map(|(prompt, salt)| Op::Start { prompt, salt }),
        2 => (0usize..8).prop_map(Op::Release),
        1 => Just(Op::ReleaseUnheld),
    ]
}

/// What the pool must hold, kept by the test independently of the pool.
#[derive(Default)]
struct Model {
    seqs: Vec<Vec<BlockId>>,
    refs: HashMap<BlockId, u32>,
    /// Sealed blocks: (salt, the whole prefix up to and including the block).
    content: HashMap<BlockId, (u8, Vec<u32>)>,
    indexed: HashSet<BlockId>,
    /// Cached blocks, least recently used first.
    lru: Vec<BlockId>,
}

fn root(salt: u8) -> BlockHash {
    BlockHash::root(b"model", &[salt])
}

fn run(total: usize, mask: u64, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut pool = BlockPool::new(total);
    pool.set_hash_key_mask(mask);
    let mut m = Model::default();
    for op in ops {
        match op {
            Op::Start { prompt, salt } => start(&mut pool, &mut m, &prompt, salt)?,
            Op::Release(i) if !m.seqs.is_empty() => {
                let blocks = m.seqs.remove(i % m.seqs.len());
                let mut t = BlockTable { blocks: blocks.clone(), tokens: 0 };
                pool.release_table(&mut t).map_err(|e| TestCaseError::fail(e.to_string()))?;
                for b in blocks.into_iter().rev() {
                    unref(&mut m, b);
                }
            }
            Op::Release(_) => {}
            Op::ReleaseUnheld => {
                if let Some(b) = (0..total as BlockId).find(|b| !m.refs.contains_key(b)) {
                    prop_assert_eq!(pool.release(b), Err(PoolError::NotAllocated(b)), "counts never go below 0");
                }
            }
        }
        check(&pool, &m, total)?;
    }
    Ok(())
}

fn unref(m: &mut Model, b: BlockId) {
    let r = m.refs.get_mut(&b).expect("model holds it");
    *r -= 1;
    if *r == 0 {
        m.refs.remove(&b);
        if m.indexed.contains(&b) {
            m.lru.push(b);
        } else {
            m.content.remove(&b);
        }
    }
}

fn start(pool: &mut BlockPool, m: &mut Model, prompt: &[u32], salt: u8) -> Result<(), TestCaseError> {
    let want_query = pool.match_prefix(root(salt), prompt, BS);
    let hit = pool.acquire_prefix(root(salt), prompt, BS, usize::MAX);
    prop_assert_eq!(&want_query, &hit, "the query sees what a hit takes");
    for (i, &b) in hit.iter().enumerate() {
        // Never wrong KV: every attached block holds exactly this prefix, under this salt.
        prop_assert_eq!(m.content.get(&b), Some(&(salt, prompt[..(i + 1) * BS].to_vec())), "block {} of a hit", i);
        m.lru.retain(|&c| c != b);
        *m.refs.entry(b).or_default() += 1;
    }
    let need = BlockTable::blocks_for(prompt.len(), BS) - hit.len();
    let unreferenced = pool.total() - m.refs.len();
    let empty = pool.empty_count();
    pool.drain_events();
    let fresh = match pool.allocate(need) {
        Ok(f) => f,
        Err(e) => {
            prop_assert!(need > unreferenced, "an allocation that fits without the cache failed: {}", e);
            let mut t = BlockTable { blocks: hit.clone(), tokens: 0 };
            pool.release_table(&mut t).map_err(|e| TestCaseError::fail(e.to_string()))?;
            for &b in hit.iter().rev() {
                unref(m, b);
            }
            return Ok(());
        }
    };
    // Eviction order is LRU: the blocks taken beyond the empty ones are the oldest cached.
    let evicted: Vec<BlockId> = pool
        .drain_events()
        .into_iter()
        .filter_map(|e| match e.kind {
            CacheEventKind::Evicted { block, .. } => Some(block),
            CacheEventKind::Stored { .. } => None,
        })
        .collect();
    let k = need.saturating_sub(empty);
    prop_assert_eq!(&evicted[..], &m.lru[..k], "evicted blocks are the least recently used");
    for b in m.lru.drain(..k) {
        m.indexed.remove(&b);
        m.content.remove(&b);
    }
    for &b in &fresh {
        prop_assert!(!m.refs.contains_key(&b), "block {} handed out while referenced", b);
        m.refs.insert(b, 1);
    }
    // Seal the new full blocks, in order.
    let blocks: Vec<BlockId> = hit.iter().chain(&fresh).copied().collect();
    for i in hit.len()..prompt.len() / BS {
        let parent = if i == 0 { Parent::Root(root(salt)) } else { Parent::Block(blocks[i - 1]) };
        let stored = pool.seal(blocks[i], parent, &prompt[i * BS..(i + 1) * BS]).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(pool.seal(blocks[i], parent, &[0, 0]), Err(PoolError::Seal { block: blocks[i], reason: "already sealed" }));
        m.content.insert(blocks[i], (salt, prompt[..(i + 1) * BS].to_vec()));
        if stored.is_some() {
            m.indexed.insert(blocks[i]);
        }
    }
    m.seqs.push(blocks);
    Ok(())
}

fn check(pool: &BlockPool, m: &Model, total: usize) -> Result<(), TestCaseError> {
    let free: HashSet<BlockId> = pool.free_list().iter().copied().collect();
    prop_assert_eq!(free.len(), pool.free_list().len(), "a block twice on the free list");
    let lru = pool.cache().lru_order();
    prop_assert_eq!(&lru, &m.lru, "cached blocks in LRU order");
    for b in 0..total as BlockId {
        let (rc, in_free, cached) = (pool.ref_count(b), free.contains(&b), pool.cache().is_cached(b));
        prop_assert_eq!(rc, m.refs.get(&b).copied().unwrap_or(0), "reference count of block {}", b);
        // Exactly one state: empty, referenced or cached.
        prop_assert_eq!(u8::from(in_free) + u8::from(rc > 0) + u8::from(cached), 1, "block {} free={} rc={} cached={}", b, in_free, rc, cached);
        if in_free {
            prop_assert!(!pool.is_sealed(b), "an empty block keeps a seal");
        }
    }
    prop_assert_eq!(pool.free_count(), total - m.refs.len());
    prop_assert_eq!(pool.cached_count() + pool.empty_count(), pool.free_count());
    prop_assert_eq!(pool.used_count(), m.refs.len());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn pool_with_cache_keeps_its_invariants(total in 1usize..12, ops in proptest::collection::vec(op(), 1..40)) {
        run(total, u64::MAX, ops)?;
    }

    /// Every block has the same index key: every lookup beyond the first block meets a collision,
    /// and hits must still be right.
    #[test]
    fn forced_collisions_never_serve_wrong_blocks(total in 1usize..12, mask in prop_oneof![Just(0u64), Just(1u64), Just(3u64)], ops in proptest::collection::vec(op(), 1..40)) {
        run(total, mask, ops)?;
    }
}

#[test]
fn hit_attaches_and_release_caches() {
    let mut pool = BlockPool::new(4);
    let r = root(0);
    let a = pool.allocate(2).unwrap();
    assert_eq!(pool.seal(a[0], Parent::Root(r), &[1, 2]), Ok(Some(r.child(&[1, 2]))));
    assert!(matches!(pool.seal(a[1], Parent::Block(3), &[3, 4]), Err(PoolError::Seal { .. })), "parent not sealed");
    pool.seal(a[1], Parent::Block(a[0]), &[3, 4]).unwrap();
    pool.release_table(&mut BlockTable { blocks: a.clone(), tokens: 4 }).unwrap();
    assert_eq!((pool.free_count(), pool.cached_count(), pool.empty_count()), (4, 2, 2));
    assert_eq!(pool.cache().lru_order(), vec![a[1], a[0]], "the child is older than its parent");
    // Another salt sees nothing; the same salt sees both blocks, and a diverging prompt one.
    assert!(pool.match_prefix(root(1), &[1, 2, 3, 4], 2).is_empty());
    assert_eq!(pool.match_prefix(r, &[1, 2, 3, 9], 2), vec![a[0]]);
    assert_eq!(pool.acquire_prefix(r, &[1, 2, 3, 4, 5], 2, usize::MAX), a);
    assert_eq!((pool.cached_count(), pool.used_count()), (0, 2));
    let s = pool.cache_stats();
    assert_eq!((s.queries, s.hits, s.hit_blocks, s.hit_tokens, s.stored), (1, 1, 2, 4, 2));
    // Allocating all the rest never touches referenced blocks; one more fails.
    let rest = pool.allocate(2).unwrap();
    assert!(rest.iter().all(|b| !a.contains(b)));
    assert!(matches!(pool.allocate(1), Err(PoolError::Exhausted { .. })));
}

#[test]
fn events_number_stores_and_evictions() {
    let mut pool = BlockPool::new(1);
    let r = root(0);
    let b = pool.allocate(1).unwrap()[0];
    let h = pool.seal(b, Parent::Root(r), &[7, 7]).unwrap().unwrap();
    pool.release(b).unwrap();
    assert_eq!(pool.allocate(1).unwrap(), vec![b], "the cached block is evicted for reuse");
    let ev = pool.drain_events();
    assert_eq!(ev.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![0, 1]);
    assert_eq!(ev[0].kind, CacheEventKind::Stored { hash: h, parent: None, block: b });
    assert_eq!(ev[1].kind, CacheEventKind::Evicted { hash: h, block: b });
    assert!(pool.drain_events().is_empty());
    assert_eq!(pool.cache_stats().evictions, 1);
    assert!(pool.match_prefix(r, &[7, 7], 2).is_empty(), "an evicted block is no hit");
}

#[test]
fn colliding_key_with_other_tokens_is_a_miss() {
    let mut pool = BlockPool::new(4);
    pool.set_hash_key_mask(0);
    let r = root(0);
    let a = pool.allocate(1).unwrap()[0];
    pool.seal(a, Parent::Root(r), &[1, 1]).unwrap();
    pool.release(a).unwrap();
    // Same key, other tokens: a miss, counted.
    assert!(pool.acquire_prefix(r, &[2, 2], 2, usize::MAX).is_empty());
    assert_eq!(pool.cache_stats().verify_misses, 1);
    // A second block with the same key is not indexed, and goes free on release.
    let b = pool.allocate(1).unwrap()[0];
    assert_eq!(pool.seal(b, Parent::Root(r), &[2, 2]), Ok(None));
    pool.release(b).unwrap();
    assert_eq!((pool.cached_count(), pool.empty_count()), (1, 3));
}
