//! KV block bookkeeping: a pool of fixed-size blocks with a free list and reference counts, and the
//! block table that maps a sequence's token positions to (block, offset) slots.
//!
//! Pure data: the KV bytes themselves live in a backend's storage, indexed by [`BlockId`]. A block
//! may be shared by several sequences (prefix sharing); when its last reference is released it
//! returns to the free list, or, if it is a sealed full block ([`BlockPool::seal`]), stays cached
//! for prefix hits until an allocation needs it (see [`crate::prefix_cache`]).
//!
//! Every block is in exactly one state: *empty* (on the free list), *referenced* (reference count
//! above 0), or *cached* (count 0, sealed, in the LRU list). [`BlockPool::free_count`] counts what
//! an allocation can take: empty plus cached.

use crate::prefix_cache::{BlockHash, CacheEvent, CacheStats, Parent, PrefixCache};
use thiserror::Error;

/// Index of a block in the pool (and in the backend's KV storage).
pub type BlockId = u32;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum PoolError {
    /// Retryable elsewhere: another worker may have room.
    #[error("KV cache exhausted: {requested} blocks requested, {free} free of {total}")]
    Exhausted { requested: usize, free: usize, total: usize },
    #[error("block {0} is not allocated")]
    NotAllocated(BlockId),
    #[error("block {0} is out of range for a pool of {1} blocks")]
    OutOfRange(BlockId, usize),
    /// A caller bug: sealing must follow the sequence's order, each block once.
    #[error("block {block} cannot be sealed: {reason}")]
    Seal { block: BlockId, reason: &'static str },
}

/// A pool of `total` blocks: free list, reference counts and the prefix cache.
#[derive(Debug, Clone)]
pub struct BlockPool {
    ref_counts: Vec<u32>,
    free: Vec<BlockId>,
    cache: PrefixCache,
}

impl BlockPool {
    pub fn new(total: usize) -> Self {
        // Pop from the back: hand out low ids first, which keeps early allocations dense.
        let free = (0..total as BlockId).rev().collect();
        Self { ref_counts: vec![0; total], free, cache: PrefixCache::new(total) }
    }

    pub fn total(&self) -> usize {
        self.ref_counts.len()
    }

    /// Blocks an allocation can take: empty ones plus cached ones (count 0, evictable).
    pub fn free_count(&self) -> usize {
        self.free.len() + self.cache.cached_count()
    }

    /// Blocks on the free list, holding nothing.
    pub fn empty_count(&self) -> usize {
        self.free.len()
    }

    /// Cached blocks: reference count 0, KV kept for prefix hits.
    pub fn cached_count(&self) -> usize {
        self.cache.cached_count()
    }

    /// Blocks referenced by at least one sequence.
    pub fn used_count(&self) -> usize {
        self.total() - self.free_count()
    }

    /// Allocate `n` blocks, all or nothing: empty blocks first, then the least recently used
    /// cached ones (evicted). Fails only when fewer than `n` blocks are unreferenced.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>, PoolError> {
        if n > self.free_count() {
            return Err(PoolError::Exhausted { requested: n, free: self.free_count(), total: self.total() });
        }
        let at = self.free.len().saturating_sub(n);
        let mut blocks: Vec<BlockId> = self.free.drain(at..).rev().collect();
        while blocks.len() < n {
            blocks.push(self.cache.evict_oldest().expect("counted above"));
        }
        for &b in &blocks {
            self.ref_counts[b as usize] = 1;
        }
        Ok(blocks)
    }

    /// Seal a full, referenced block: record its tokens and give it its hash (chained from
    /// `parent`), so that it stays cached after its last release. Returns the hash, or None when
    /// the index already held that key (the block is then freed as usual on release). Sealing
    /// makes the block immutable: the caller writes no more KV into it.
    pub fn seal(&mut self, block: BlockId, parent: Parent, tokens: &[u32]) -> Result<Option<BlockHash>, PoolError> {
        if *self.rc_mut(block)? == 0 {
            return Err(PoolError::NotAllocated(block));
        }
        if self.cache.is_sealed(block) {
            return Err(PoolError::Seal { block, reason: "already sealed" });
        }
        if let Parent::Block(p) = parent {
            self.rc_mut(p)?;
        }
        match self.cache.seal(block, parent, tokens) {
            Some((hash, indexed)) => Ok(indexed.then_some(hash)),
            None => Err(PoolError::Seal { block, reason: "its parent block is not sealed" }),
        }
    }

    /// Whether `block` is sealed (full and immutable).
    pub fn is_sealed(&self, block: BlockId) -> bool {
        self.cache.is_sealed(block)
    }

    /// The cached blocks holding the leading full blocks of `tokens` under `root`, without taking
    /// them (a query: counters unchanged).
    pub fn match_prefix(&self, root: BlockHash, tokens: &[u32], block_size: usize) -> Vec<BlockId> {
        self.cache.walk(root, tokens, block_size, usize::MAX).0
    }

    /// Take a reference to each block of the longest cached prefix of `tokens` under `root`, at
    /// most `max_blocks`, for a new sequence's table (no copy). Counts a query.
    pub fn acquire_prefix(&mut self, root: BlockHash, tokens: &[u32], block_size: usize, max_blocks: usize) -> Vec<BlockId> {
        let (blocks, verify_miss) = self.cache.walk(root, tokens, block_size, max_blocks);
        for &b in &blocks {
            self.cache.take(b);
            self.ref_counts[b as usize] += 1;
        }
        self.cache.record_query(blocks.len(), block_size, verify_miss);
        blocks
    }

    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    /// The stored/evicted events logged since the last drain, oldest first.
    pub fn drain_events(&mut self) -> Vec<CacheEvent> {
        self.cache.drain_events()
    }

    /// The prefix cache, read-only (LRU order, hashes).
    pub fn cache(&self) -> &PrefixCache {
        &self.cache
    }

    /// Test hook: see [`PrefixCache::set_key_mask`].
    pub fn set_hash_key_mask(&mut self, mask: u64) {
        self.cache.set_key_mask(mask);
    }

    /// Add a reference to an allocated block (sharing).
    pub fn retain(&mut self, block: BlockId) -> Result<(), PoolError> {
        let rc = self.rc_mut(block)?;
        if *rc == 0 {
            return Err(PoolError::NotAllocated(block));
        }
        *rc += 1;
        Ok(())
    }

    /// Drop one reference; the block is freed when none remain.
    pub fn release(&mut self, block: BlockId) -> Result<(), PoolError> {
        let rc = self.rc_mut(block)?;
        if *rc == 0 {
            return Err(PoolError::NotAllocated(block));
        }
        *rc -= 1;
        if *rc == 0 && !self.cache.on_unreferenced(block) {
            self.free.push(block);
        }
        Ok(())
    }

    /// Release every block of a table and empty it. Last block first, so that cached parents
    /// are used more recently than their children and outlive them in the LRU order.
    pub fn release_table(&mut self, table: &mut BlockTable) -> Result<(), PoolError> {
        for b in table.blocks.drain(..).rev() {
            self.release(b)?;
        }
        table.tokens = 0;
        Ok(())
    }

    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_counts.get(block as usize).copied().unwrap_or(0)
    }

    /// The free list (tests check the block states against it).
    #[cfg(test)]
    pub(crate) fn free_list(&self) -> &[BlockId] {
        &self.free
    }

    fn rc_mut(&mut self, block: BlockId) -> Result<&mut u32, PoolError> {
        let total = self.ref_counts.len();
        self.ref_counts.get_mut(block as usize).ok_or(PoolError::OutOfRange(block, total))
    }
}

/// The blocks holding one sequence's KV, in position order, and how many token slots are filled.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    pub blocks: Vec<BlockId>,
    pub tokens: usize,
}

impl BlockTable {
    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(tokens: usize, block_size: usize) -> usize {
        tokens.div_ceil(block_size)
    }

    /// Additional blocks needed to append `n` tokens.
    pub fn blocks_to_append(&self, n: usize, block_size: usize) -> usize {
        Self::blocks_for(self.tokens + n, block_size).saturating_sub(self.blocks.len())
    }

    /// Grow the table so that `n` more tokens fit, taking blocks from the pool (all or nothing).
    pub fn reserve(&mut self, pool: &mut BlockPool, n: usize, block_size: usize) -> Result<(), PoolError> {
        let need = self.blocks_to_append(n, block_size);
        if need > 0 {
            self.blocks.extend(pool.allocate(need)?);
        }
        Ok(())
    }

    /// The flat slot (block * block_size + offset) of token position `pos`.
    /// Panics if `pos` is beyond the table's blocks (a caller bug: reserve first).
    pub fn slot(&self, pos: usize, block_size: usize) -> u32 {
        self.blocks[pos / block_size] * block_size as u32 + (pos % block_size) as u32
    }

    /// Slots for `n` tokens appended after the current ones; marks them filled.
    /// Panics if the table was not reserved for them (a caller bug).
    pub fn append_slots(&mut self, n: usize, block_size: usize) -> Vec<u32> {
        let slots = (self.tokens..self.tokens + n).map(|p| self.slot(p, block_size)).collect();
        self.tokens += n;
        slots
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_release_roundtrip() {
        let mut pool = BlockPool::new(4);
        let a = pool.allocate(3).unwrap();
        assert_eq!(a, vec![0, 1, 2]);
        assert_eq!(pool.free_count(), 1);
        assert_eq!(
            pool.allocate(2),
            Err(PoolError::Exhausted { requested: 2, free: 1, total: 4 })
        );
        // all-or-nothing: the failed allocation took nothing
        assert_eq!(pool.free_count(), 1);
        for b in a {
            pool.release(b).unwrap();
        }
        assert_eq!(pool.free_count(), 4);
    }

    #[test]
    fn shared_block_freed_on_last_release() {
        let mut pool = BlockPool::new(2);
        let b = pool.allocate(1).unwrap()[0];
        pool.retain(b).unwrap();
        pool.release(b).unwrap();
        assert_eq!(pool.free_count(), 1);
        pool.release(b).unwrap();
        assert_eq!(pool.free_count(), 2);
        assert_eq!(pool.release(b), Err(PoolError::NotAllocated(b)));
        assert_eq!(pool.retain(7), Err(PoolError::OutOfRange(7, 2)));
    }

    #[test]
    fn table_reserve_and_slots() {
        let mut pool = BlockPool::new(8);
        let mut t = BlockTable::default();
        t.reserve(&mut pool, 5, 4).unwrap();
        assert_eq!(t.blocks.len(), 2);
        let s = t.append_slots(5, 4);
        assert_eq!(s, vec![0, 1, 2, 3, 4]);
        t.reserve(&mut pool, 3, 4).unwrap(); // 8 tokens fit in 2 blocks
        assert_eq!(t.blocks.len(), 2);
        t.reserve(&mut pool, 4, 4).unwrap();
        assert_eq!(t.blocks.len(), 3);
        pool.release_table(&mut t).unwrap();
        assert_eq!(pool.free_count(), 8);
        assert_eq!(t.tokens, 0);
    }

    #[test]
    fn blocks_for_table() {
        for (tokens, bs, want) in [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (33, 16, 3)] {
            assert_eq!(BlockTable::blocks_for(tokens, bs), want, "{tokens} tokens, block {bs}");
        }
    }
}
