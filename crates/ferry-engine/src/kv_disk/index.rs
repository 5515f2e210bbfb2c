//! The disk tier's index, pure data: which blocks are on disk, what chain each continues, and
//! which goes first when the tier is over its size.
//!
//! Eviction is least recently used, with one rule on top: a block that another block on disk
//! continues is not evicted before that child (a parent goes only once it is a leaf). A chain
//! cut in the middle is worth nothing past the cut, so what stays is always a usable chain from
//! its root. Reads touch a chain leaf first, so its root is the most recently used.

use ferry_core::BlockHash;
use std::collections::{BTreeMap, HashMap, HashSet};

/// One block on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The hash the block continues (its chain's root for a first block).
    pub parent: BlockHash,
    pub tokens: Box<[u32]>,
    /// Its file's size.
    pub bytes: u64,
    tick: u64,
    /// Blocks on disk that continue this one.
    children: u32,
}

/// Blocks on disk, at most `capacity` bytes of files.
#[derive(Debug, Default)]
pub struct Index {
    entries: HashMap<BlockHash, Entry>,
    lru: BTreeMap<u64, BlockHash>,
    tick: u64,
    bytes: u64,
    capacity: u64,
    /// Offered for writing and not written yet (so a block is not exported twice).
    pending: HashSet<BlockHash>,
}

impl Index {
    pub fn new(capacity: u64) -> Index {
        Index { capacity, ..Default::default() }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of files the index holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn get(&self, hash: BlockHash) -> Option<&Entry> {
        self.entries.get(&hash)
    }

    /// On disk or on its way there.
    pub fn has_or_pending(&self, hash: BlockHash) -> bool {
        self.entries.contains_key(&hash) || self.pending.contains(&hash)
    }

    /// Mark `hash` as on its way to disk; false if it is there or on its way already.
    pub fn reserve(&mut self, hash: BlockHash) -> bool {
        !self.entries.contains_key(&hash) && self.pending.insert(hash)
    }

    /// The write of `hash` did not happen (its queue was full, the write failed).
    pub fn unreserve(&mut self, hash: BlockHash) {
        self.pending.remove(&hash);
    }

    /// Hashes on disk (for a snapshot).
    pub fn hashes(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.entries.keys().copied()
    }

    /// Record a block written to disk (as the most recently used); returns the blocks evicted
    /// to make room, whose files the caller deletes. A block larger than the whole capacity, or
    /// one whose chain alone fills the tier, is not kept: it is returned as evicted itself.
    pub fn insert(&mut self, hash: BlockHash, parent: BlockHash, tokens: &[u32], bytes: u64) -> Vec<BlockHash> {
        self.pending.remove(&hash);
        if self.entries.contains_key(&hash) {
            return Vec::new();
        }
        if bytes > self.capacity {
            return vec![hash];
        }
        self.tick += 1;
        if let Some(p) = self.entries.get_mut(&parent) {
            p.children += 1;
        }
        self.entries.insert(hash, Entry { parent, tokens: tokens.into(), bytes, tick: self.tick, children: 0 });
        self.lru.insert(self.tick, hash);
        self.bytes += bytes;
        let mut evicted = Vec::new();
        while self.bytes > self.capacity {
            // Only the new block is a leaf (one chain longer than the tier): its root side is
            // worth more than its tail, so the new block is what goes.
            let h = self.oldest_leaf(hash).unwrap_or(hash);
            self.remove(h);
            evicted.push(h);
        }
        evicted
    }

    /// The least recently used block no other block on disk continues, other than `keep`.
    fn oldest_leaf(&self, keep: BlockHash) -> Option<BlockHash> {
        self.lru.values().copied().find(|h| *h != keep && self.entries.get(h).is_some_and(|e| e.children == 0))
    }

    /// Count each block's children again (after blocks were inserted in an order where a child
    /// may have come before its parent: a directory scanned at open).
    pub fn recount_children(&mut self) {
        let parents: Vec<BlockHash> = self.entries.values().map(|e| e.parent).collect();
        for e in self.entries.values_mut() {
            e.children = 0;
        }
        for p in parents {
            if let Some(e) = self.entries.get_mut(&p) {
                e.children += 1;
            }
        }
    }

    /// Forget a block (evicted, or its file found corrupt).
    pub fn remove(&mut self, hash: BlockHash) -> Option<Entry> {
        let e = self.entries.remove(&hash)?;
        self.lru.remove(&e.tick);
        self.bytes -= e.bytes;
        if let Some(p) = self.entries.get_mut(&e.parent) {
            p.children = p.children.saturating_sub(1);
        }
        Some(e)
    }

    /// The blocks on disk that continue the chain at `parent` with the full blocks of `tokens`,
    /// at most `max_blocks`, each checked against its parent and its tokens (a hash collision
    /// ends the run).
    pub fn chain(&self, mut parent: BlockHash, tokens: &[u32], block_size: usize, max_blocks: usize) -> Vec<BlockHash> {
        let mut out = Vec::new();
        for chunk in tokens.chunks_exact(block_size).take(max_blocks) {
            let hash = parent.child(chunk);
            match self.entries.get(&hash) {
                Some(e) if e.parent == parent && *e.tokens == *chunk => out.push(hash),
                _ => break,
            }
            parent = hash;
        }
        out
    }

    /// A chain was read: its blocks become the most recently used, leaf first, so the root is
    /// the newest of them.
    pub fn touch_chain(&mut self, chain: &[BlockHash]) {
        for h in chain.iter().rev() {
            if let Some(e) = self.entries.get_mut(h) {
                self.lru.remove(&e.tick);
                self.tick += 1;
                e.tick = self.tick;
                self.lru.insert(self.tick, *h);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chain of `n` blocks of 2 tokens from `root`, token ids from `first`.
    fn chain(root: BlockHash, first: u32, n: usize) -> (Vec<u32>, Vec<BlockHash>) {
        let tokens: Vec<u32> = (first..first + 2 * n as u32).collect();
        (tokens.clone(), ferry_core::prefix_cache::block_hashes(root, &tokens, 2))
    }

    fn put(ix: &mut Index, root: BlockHash, tokens: &[u32], hashes: &[BlockHash], bytes: u64) -> Vec<BlockHash> {
        let mut evicted = Vec::new();
        let mut parent = root;
        for (c, &h) in tokens.chunks(2).zip(hashes) {
            evicted.extend(ix.insert(h, parent, c, bytes));
            parent = h;
        }
        evicted
    }

    #[test]
    fn a_chain_is_found_from_any_point_and_checked() {
        let root = BlockHash::root(b"m", b"");
        let (t, hs) = chain(root, 10, 4);
        let mut ix = Index::new(1000);
        put(&mut ix, root, &t, &hs, 10);
        assert_eq!(ix.chain(root, &t, 2, usize::MAX), hs);
        assert_eq!(ix.chain(root, &t, 2, 2), hs[..2]);
        // From the second block on (the pool held the first).
        assert_eq!(ix.chain(hs[0], &t[2..], 2, usize::MAX), hs[1..]);
        // Other tokens, another root: nothing.
        assert!(ix.chain(BlockHash::root(b"other", b""), &t, 2, usize::MAX).is_empty());
        let mut other = t.clone();
        other[5] = 99;
        assert_eq!(ix.chain(root, &other, 2, usize::MAX), hs[..2]);
        assert_eq!((ix.len(), ix.bytes()), (4, 40));
    }

    #[test]
    fn eviction_takes_the_oldest_leaf_and_keeps_chains_whole() {
        let root = BlockHash::root(b"m", b"");
        let (ta, a) = chain(root, 0, 3);
        let (tb, b) = chain(root, 100, 2);
        let mut ix = Index::new(50);
        assert!(put(&mut ix, root, &ta, &a, 10).is_empty());
        assert!(put(&mut ix, root, &tb, &b, 10).is_empty());
        // Full (50). One more block: the oldest *leaf* goes, a[2], not the oldest block a[0].
        let (tc, c) = chain(root, 200, 1);
        assert_eq!(put(&mut ix, root, &tc, &c, 10), vec![a[2]]);
        assert_eq!(ix.chain(root, &ta, 2, usize::MAX), a[..2], "the rest of a's chain is usable");
        // Reading a's chain makes it the newest: b's leaf goes next, then b's root.
        ix.touch_chain(&a[..2]);
        let (td, d) = chain(root, 300, 2);
        assert_eq!(put(&mut ix, root, &td, &d, 10), vec![b[1], b[0]]);
        assert_eq!(ix.bytes(), 50);
        assert!(ix.get(a[0]).is_some() && ix.get(b[0]).is_none());
    }

    #[test]
    fn reservations_and_oversize_blocks() {
        let root = BlockHash::root(b"m", b"");
        let mut ix = Index::new(10);
        let h = root.child(&[1, 2]);
        assert!(ix.reserve(h) && !ix.reserve(h) && ix.has_or_pending(h));
        ix.unreserve(h);
        assert!(!ix.has_or_pending(h));
        assert!(ix.reserve(h));
        assert!(ix.insert(h, root, &[1, 2], 10).is_empty());
        assert!(!ix.reserve(h), "on disk: nothing to write");
        // Bigger than the whole tier: never kept.
        let big = root.child(&[3, 4]);
        assert_eq!(ix.insert(big, root, &[3, 4], 11), vec![big]);
        assert_eq!(ix.len(), 1);
        assert_eq!(ix.remove(h).map(|e| e.bytes), Some(10));
        assert_eq!((ix.len(), ix.bytes()), (0, 0));
    }
}
