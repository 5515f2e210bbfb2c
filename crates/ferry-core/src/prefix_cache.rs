//! Content-addressed KV blocks: the bookkeeping of prefix caching (vLLM's automatic prefix caching;
//! SGLang's RadixAttention, arXiv 2312.07104, holds the same idea as a radix tree).
//!
//! A *full* block's [`BlockHash`] chains its parent's hash with its token ids; the chain starts at a
//! root that hashes the model fingerprint and a cache salt ([`BlockHash::root`]), so two models or
//! two tenants never share blocks. [`crate::BlockPool`] owns a [`PrefixCache`] and drives it:
//!
//! - **seal** ([`crate::BlockPool::seal`]): a block whose last slot is written gets its hash and an
//!   index entry (hash → block), and stores its token ids. A sealed block is immutable; only full
//!   blocks are sealed, so only full blocks are ever shared.
//! - **release**: a sealed, indexed block whose reference count falls to 0 stays *cached*: it
//!   joins an LRU list instead of the free list, its KV intact.
//! - **hit** ([`crate::BlockPool::acquire_prefix`]): the longest chain of cached blocks that matches
//!   a token list is attached to a new sequence (reference counts up, no copy).
//! - **evict**: an allocation takes empty blocks first and then the least recently used cached
//!   blocks, so the cache never makes an allocation fail that would fit without it.
//!
//! A hit is verified, not trusted to the hash: each block stores its token ids and a link to its
//! parent (the root hash for a first block, else the parent's *stamp*, a number unique to one
//! sealing of one block, so a parent evicted and reused for other tokens breaks the link). A hash
//! collision is therefore a miss, never wrong KV. [`PrefixCache::set_key_mask`] narrows the index
//! key so tests can force collisions.
//!
//! Every block stored in or evicted from the index is logged as a [`CacheEvent`] with a
//! monotonically increasing sequence number (for KV-aware routing: a router replays them to know
//! which worker holds which chain). The log keeps the newest [`EVENT_CAPACITY`] events; a consumer
//! that sees a gap in the numbers has missed some and should resynchronize.

use crate::block_pool::BlockId;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap, VecDeque};

/// Most events kept for [`crate::BlockPool::drain_events`]; older ones are dropped.
pub const EVENT_CAPACITY: usize = 1 << 16;

/// The content address of a full block (the first 64 bits of a SHA-256 chain).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

impl BlockHash {
    /// The start of every chain for one model and one cache salt (empty salt: shared by all).
    pub fn root(fingerprint: &[u8], salt: &[u8]) -> Self {
        let mut h = Sha256::new();
        h.update(b"ferry-prefix-root-v1");
        h.update((fingerprint.len() as u64).to_le_bytes());
        h.update(fingerprint);
        h.update((salt.len() as u64).to_le_bytes());
        h.update(salt);
        Self::from_digest(h)
    }

    /// The root of a cache that stores its KV as `dtype`: the stored layout is part of what a
    /// block is ([`crate::KvDtype::layout_name`]), so the same tokens cached as int8 and as f32,
    /// or as int8 of an earlier layout, are different blocks. An f32 cache's root is
    /// [`BlockHash::root`] of the fingerprint alone (the addresses every earlier worker used).
    pub fn cache_root(fingerprint: &[u8], dtype: crate::KvDtype, salt: &[u8]) -> Self {
        match dtype {
            crate::KvDtype::F32 => Self::root(fingerprint, salt),
            d => Self::root(&[fingerprint, b"\0kv-dtype=", d.layout_name().as_bytes()].concat(), salt),
        }
    }

    /// The hash of a block holding `tokens` whose parent (the previous block, or the root) is `self`.
    pub fn child(self, tokens: &[u32]) -> Self {
        let mut bytes = Vec::with_capacity(8 + 8 + 4 * tokens.len());
        bytes.extend_from_slice(&self.0.to_le_bytes());
        bytes.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
        for t in tokens {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let mut h = Sha256::new();
        h.update(b"ferry-prefix-block-v1");
        h.update(&bytes);
        Self::from_digest(h)
    }

    fn from_digest(h: Sha256) -> Self {
        let d = h.finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&d[..8]);
        BlockHash(u64::from_le_bytes(first))
    }
}

/// The hashes of the full blocks of `tokens` (a trailing partial block has none).
pub fn block_hashes(root: BlockHash, tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut parent = root;
    tokens
        .chunks_exact(block_size)
        .map(|c| {
            parent = parent.child(c);
            parent
        })
        .collect()
}

/// A tenant's identity in the cache: a digest of the API key its requests authenticated with
/// (never the key itself, which stays on the router). The same on every router, so a tenant's
/// blocks are shared across routers and router restarts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tenant(pub [u8; 32]);

impl Tenant {
    pub fn of_key(api_key: &[u8]) -> Tenant {
        let mut h = Sha256::new();
        h.update(b"ferry-tenant-v1");
        h.update(api_key);
        Tenant(h.finalize().into())
    }
}

/// The salt a request's blocks are cached under: its tenant's digest (when API keys are on),
/// then the salt the request asked for. With a tenant the salt always starts with its 32 bytes,
/// so no request salt can reach another tenant's chains; without one, requests share the cache
/// unless they ask for a salt.
pub fn cache_salt(tenant: Option<&Tenant>, requested: &[u8]) -> Vec<u8> {
    let mut salt = Vec::with_capacity(32 + requested.len());
    if let Some(t) = tenant {
        salt.extend_from_slice(&t.0);
    }
    salt.extend_from_slice(requested);
    salt
}

/// What a block being sealed follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parent {
    /// The first block of a sequence: the chain's root ([`BlockHash::root`]).
    Root(BlockHash),
    /// The previous block of the sequence (already sealed).
    Block(BlockId),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheEvent {
    /// Increases by one per event, from 0.
    pub seq: u64,
    pub kind: CacheEventKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheEventKind {
    /// A block entered the index. `parent` is None for the first block of a chain.
    Stored { hash: BlockHash, parent: Option<BlockHash>, block: BlockId },
    /// A cached block left the index to be reused.
    Evicted { hash: BlockHash, block: BlockId },
}

/// A full block written to (`stored`) or deleted from (`!stored`) a worker's disk tier
/// (`--kv-disk`): the second tier of the prefix cache, whose blocks are loaded instead of computed.
/// The engine drains them like [`CacheEvent`]s; the worker's event log numbers and publishes them
/// tagged with their tier, so the router's index ([`crate::kv_index`]) knows what each worker can
/// load from disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiskEvent {
    pub stored: bool,
    pub hash: BlockHash,
}

/// Counters since the pool was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Prefix lookups that could take blocks ([`crate::BlockPool::acquire_prefix`]).
    pub queries: u64,
    /// Lookups that attached at least one block.
    pub hits: u64,
    pub hit_blocks: u64,
    pub hit_tokens: u64,
    /// Blocks that entered the index.
    pub stored: u64,
    pub evictions: u64,
    /// Lookups stopped by an index entry whose tokens or parent did not match (a hash collision,
    /// or a chain whose parent was evicted).
    pub verify_misses: u64,
}

/// How a sealed block links to its parent, checked on every hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Link {
    Root(BlockHash),
    Block { stamp: u64 },
}

#[derive(Clone, Debug)]
struct Sealed {
    hash: BlockHash,
    link: Link,
    stamp: u64,
    tokens: Box<[u32]>,
    /// Whether the index points at this block (false: another block had the key first).
    indexed: bool,
    /// The block's place in the LRU list while cached (reference count 0).
    lru: Option<u64>,
}

/// The index and LRU list of content-addressed blocks; owned and driven by [`crate::BlockPool`],
/// which keeps reference counts and the free list.
#[derive(Clone, Debug)]
pub struct PrefixCache {
    meta: Vec<Option<Sealed>>,
    index: HashMap<u64, BlockId>,
    lru: BTreeMap<u64, BlockId>,
    tick: u64,
    stamp: u64,
    key_mask: u64,
    events: VecDeque<CacheEvent>,
    event_seq: u64,
    stats: CacheStats,
}

impl PrefixCache {
    pub(crate) fn new(total: usize) -> Self {
        Self {
            meta: vec![None; total],
            index: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            stamp: 0,
            key_mask: u64::MAX,
            events: VecDeque::new(),
            event_seq: 0,
            stats: CacheStats::default(),
        }
    }

    /// Test hook: index blocks by `hash & mask` (0: every block has the same key, so every lookup
    /// meets a collision). Set it before anything is sealed.
    pub fn set_key_mask(&mut self, mask: u64) {
        self.key_mask = mask;
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Blocks cached with reference count 0 (evictable).
    pub fn cached_count(&self) -> usize {
        self.lru.len()
    }

    pub fn is_sealed(&self, block: BlockId) -> bool {
        self.meta.get(block as usize).is_some_and(Option::is_some)
    }

    pub fn is_cached(&self, block: BlockId) -> bool {
        self.meta.get(block as usize).and_then(Option::as_ref).is_some_and(|m| m.lru.is_some())
    }

    /// The hash of a sealed block.
    pub fn hash_of(&self, block: BlockId) -> Option<BlockHash> {
        self.meta.get(block as usize).and_then(Option::as_ref).map(|m| m.hash)
    }

    /// Cached blocks, least recently used first.
    pub fn lru_order(&self) -> Vec<BlockId> {
        self.lru.values().copied().collect()
    }

    /// Seal `block` (referenced, not sealed) with its tokens; returns its hash and whether it
    /// entered the index. `None` when the parent block is not sealed (then nothing is recorded).
    pub(crate) fn seal(&mut self, block: BlockId, parent: Parent, tokens: &[u32]) -> Option<(BlockHash, bool)> {
        let (link, parent_hash) = match parent {
            Parent::Root(root) => (Link::Root(root), root),
            Parent::Block(p) => {
                let m = self.meta.get(p as usize)?.as_ref()?;
                (Link::Block { stamp: m.stamp }, m.hash)
            }
        };
        let hash = parent_hash.child(tokens);
        let key = hash.0 & self.key_mask;
        let indexed = !self.index.contains_key(&key);
        if indexed {
            self.index.insert(key, block);
            self.stats.stored += 1;
            let parent = matches!(parent, Parent::Block(_)).then_some(parent_hash);
            self.log(CacheEventKind::Stored { hash, parent, block });
        }
        self.stamp += 1;
        self.meta[block as usize] = Some(Sealed { hash, link, stamp: self.stamp, tokens: tokens.into(), indexed, lru: None });
        Some((hash, indexed))
    }

    /// The last reference to `block` is gone: true if it stays cached (joins the LRU list), false
    /// if it goes to the free list (its seal, if any, is forgotten).
    pub(crate) fn on_unreferenced(&mut self, block: BlockId) -> bool {
        let slot = &mut self.meta[block as usize];
        match slot {
            Some(m) if m.indexed => {
                self.tick += 1;
                m.lru = Some(self.tick);
                self.lru.insert(self.tick, block);
                true
            }
            _ => {
                *slot = None;
                false
            }
        }
    }

    /// A cached block is referenced again (a hit): it leaves the LRU list.
    pub(crate) fn take(&mut self, block: BlockId) {
        if let Some(m) = self.meta[block as usize].as_mut()
            && let Some(t) = m.lru.take()
        {
            self.lru.remove(&t);
        }
    }

    /// Evict the least recently used cached block, for reuse.
    pub(crate) fn evict_oldest(&mut self) -> Option<BlockId> {
        let (_, block) = self.lru.pop_first()?;
        if let Some(m) = self.meta[block as usize].take() {
            let key = m.hash.0 & self.key_mask;
            if self.index.get(&key) == Some(&block) {
                self.index.remove(&key);
            }
            self.stats.evictions += 1;
            self.log(CacheEventKind::Evicted { hash: m.hash, block });
        }
        Some(block)
    }

    /// The longest verified chain of sealed blocks holding the leading full blocks of `tokens`
    /// under `root`, at most `max_blocks`; and whether an index entry failed verification.
    pub(crate) fn walk(&self, root: BlockHash, tokens: &[u32], block_size: usize, max_blocks: usize) -> (Vec<BlockId>, bool) {
        let (mut out, mut parent, mut link) = (Vec::new(), root, Link::Root(root));
        for chunk in tokens.chunks_exact(block_size).take(max_blocks) {
            let hash = parent.child(chunk);
            let Some(&b) = self.index.get(&(hash.0 & self.key_mask)) else { return (out, false) };
            match self.meta[b as usize].as_ref() {
                Some(m) if m.link == link && *m.tokens == *chunk => {
                    out.push(b);
                    parent = m.hash;
                    link = Link::Block { stamp: m.stamp };
                }
                _ => return (out, true),
            }
        }
        (out, false)
    }

    pub(crate) fn record_query(&mut self, blocks: usize, block_size: usize, verify_miss: bool) {
        self.stats.queries += 1;
        self.stats.hits += u64::from(blocks > 0);
        self.stats.hit_blocks += blocks as u64;
        self.stats.hit_tokens += (blocks * block_size) as u64;
        self.stats.verify_misses += u64::from(verify_miss);
    }

    pub(crate) fn drain_events(&mut self) -> Vec<CacheEvent> {
        self.events.drain(..).collect()
    }

    fn log(&mut self, kind: CacheEventKind) {
        if self.events.len() == EVENT_CAPACITY {
            self.events.pop_front();
        }
        self.events.push_back(CacheEvent { seq: self.event_seq, kind });
        self.event_seq += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenants_never_share_a_salt() {
        let (a, b) = (Tenant::of_key(b"key-a"), Tenant::of_key(b"key-b"));
        assert_ne!(a, b);
        assert_eq!(a, Tenant::of_key(b"key-a"), "stable: every router derives the same tenant");
        assert!(!a.0.windows(5).any(|w| w == b"key-a"), "the key itself is not in the salt");
        // Whatever salt a tenant asks for, it cannot reach another tenant's or the shared chains.
        let roots = |t: Option<&Tenant>, s: &[u8]| BlockHash::root(b"m", &cache_salt(t, s));
        assert_ne!(roots(Some(&a), b""), roots(Some(&b), b""));
        assert_ne!(roots(Some(&a), b""), roots(None, b""));
        assert_ne!(roots(Some(&a), b"x"), roots(Some(&b), b"x"));
        assert_ne!(roots(Some(&a), &b.0), roots(Some(&b), b""), "a salt equal to another tenant's digest");
        // Same tenant and salt: the same chains; another salt: others.
        assert_eq!(roots(Some(&a), b"x"), roots(Some(&a), b"x"));
        assert_ne!(roots(Some(&a), b"x"), roots(Some(&a), b"y"));
        assert_eq!(cache_salt(None, b""), Vec::<u8>::new(), "no keys, no salt: the shared cache");
    }

    #[test]
    fn hashes_chain_and_separate_salts() {
        let root = BlockHash::root(b"model", b"");
        let hs = block_hashes(root, &[1, 2, 3, 4, 5, 6, 7], 3);
        assert_eq!(hs.len(), 2, "the partial block has no hash");
        assert_eq!(hs[0], root.child(&[1, 2, 3]));
        assert_eq!(hs[1], hs[0].child(&[4, 5, 6]));
        // The same tokens after another parent, under another salt or model: other hashes.
        assert_ne!(block_hashes(root, &[9, 9, 9, 4, 5, 6], 3)[1], hs[1]);
        assert_ne!(block_hashes(BlockHash::root(b"model", b"tenant"), &[1, 2, 3], 3)[0], hs[0]);
        assert_ne!(block_hashes(BlockHash::root(b"other", b""), &[1, 2, 3], 3)[0], hs[0]);
        // Length-prefixed fields: moving a byte between fingerprint and salt changes the root.
        assert_ne!(BlockHash::root(b"ab", b"c"), BlockHash::root(b"a", b"bc"));
        // Pinned: routers on other machines must compute the same chain (SHA-256, little-endian).
        assert_eq!(BlockHash::root(b"", b"").child(&[1, 2]), BlockHash(0x6d44_2a52_98bf_0a11));
    }
}
