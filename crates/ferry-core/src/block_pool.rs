//! KV block bookkeeping: a pool of fixed-size blocks with a free list and reference counts, and the
//! block table that maps a sequence's token positions to (block, offset) slots.
//!
//! Pure data: the KV bytes themselves live in a backend's storage, indexed by [`BlockId`]. A block
//! may be shared by several sequences (prefix sharing, forks); it returns to the free list when its
//! last reference is released.

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
}

/// A pool of `total` blocks: free list plus reference counts.
#[derive(Debug, Clone)]
pub struct BlockPool {
    ref_counts: Vec<u32>,
    free: Vec<BlockId>,
}

impl BlockPool {
    pub fn new(total: usize) -> Self {
        // Pop from the back: hand out low ids first, which keeps early allocations dense.
        let free = (0..total as BlockId).rev().collect();
        Self { ref_counts: vec![0; total], free }
    }

    pub fn total(&self) -> usize {
        self.ref_counts.len()
    }

    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    pub fn used_count(&self) -> usize {
        self.total() - self.free_count()
    }

    /// Allocate `n` blocks, all or nothing.
    pub fn allocate(&mut self, n: usize) -> Result<Vec<BlockId>, PoolError> {
        if n > self.free.len() {
            return Err(PoolError::Exhausted { requested: n, free: self.free.len(), total: self.total() });
        }
        let at = self.free.len() - n;
        let blocks: Vec<BlockId> = self.free.drain(at..).rev().collect();
        for &b in &blocks {
            self.ref_counts[b as usize] = 1;
        }
        Ok(blocks)
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
        if *rc == 0 {
            self.free.push(block);
        }
        Ok(())
    }

    /// Release every block of a table and empty it.
    pub fn release_table(&mut self, table: &mut BlockTable) -> Result<(), PoolError> {
        for b in table.blocks.drain(..) {
            self.release(b)?;
        }
        table.tokens = 0;
        Ok(())
    }

    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_counts.get(block as usize).copied().unwrap_or(0)
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
