//! Prefix caching in the engine: which token ids each sequence's KV holds, sealing blocks as they
//! fill, and attaching cached blocks to new sequences (the bookkeeping is
//! [`ferry_core::prefix_cache`]; this module feeds it the engine's sequences).
//!
//! A sequence knows its token ids when they came through [`Engine::step`] (or with an import,
//! [`Engine::import_kv_with_tokens`]); every block that fills is then sealed with its hash, chained
//! from a root of the model fingerprint and the sequence's cache salt. On release the sealed blocks
//! stay cached. Then:
//!
//! - [`Engine::new_sequence_from_cache`] starts a sequence on a prompt's cached prefix (whole
//!   blocks, at most `prompt.len() - 1` tokens so one is left to compute the logits); `step` or
//!   `prefill` with the rest of the prompt computes only that suffix, from position k·block_size.
//! - [`Engine::cached_prefix_len`] asks how many leading tokens are cached, taking nothing.
//! - [`Engine::export_kv_from`] and [`Engine::import_kv_onto`] move only the tokens after a
//!   block offset, onto a sequence that holds the first blocks (a decode worker with a cache hit).
//!
//! - [`Engine::fork`] starts another sequence on all of a sequence's KV (one more choice of an
//!   `n`-choice request): full blocks are shared, the last partial block is copied.
//!
//! Only full blocks are shared, and a shared block is never written ([`Engine::step`] asserts it).

use super::{Engine, SeqId};
use crate::backend::{Backend, KvBuffer};
use crate::error::{EngineError, Result};
use ferry_core::{BlockHash, BlockTable, CacheEvent, CacheStats, KvPayloadError, KvSpan, Parent};

/// The disk blocks [`Engine::prefetch_prefix`] asked the reader for.
#[derive(Clone, Debug, Default)]
pub struct Prefetch {
    chain: Vec<BlockHash>,
}

/// One sequence: its blocks and what the prefix cache needs to know of it.
pub(crate) struct Seq {
    pub(crate) table: BlockTable,
    /// The chain root: model fingerprint and this sequence's cache salt.
    root: BlockHash,
    /// The token ids whose KV the table holds (`table.tokens` of them), while known. None: the
    /// cache is off, or KV came without its ids; nothing more of this sequence is sealed.
    tokens: Option<Vec<u32>>,
    /// Leading blocks sealed so far.
    sealed: usize,
}

/// The index of the block where tokens from `start` begin, if `start` is a block boundary within
/// the table.
pub(crate) fn span_start_block(t: &BlockTable, start: usize, block_size: usize) -> Result<usize> {
    if !start.is_multiple_of(block_size) {
        return Err(KvPayloadError::StartNotBlockAligned { start, block_size }.into());
    }
    if start > t.tokens {
        return Err(KvPayloadError::SpanMismatch { start, holds: t.tokens }.into());
    }
    Ok(start / block_size)
}

impl<B: Backend> Engine<B> {
    fn root(&self, salt: &[u8]) -> BlockHash {
        BlockHash::cache_root(self.fingerprint.as_bytes(), self.layout.dtype, salt)
    }

    fn insert_seq(&mut self, table: BlockTable, salt: &[u8], tokens: Option<Vec<u32>>) -> SeqId {
        let id = SeqId(self.next_seq);
        self.next_seq += 1;
        let sealed = table.blocks.len().min(table.tokens / self.layout.block_size);
        let tokens = tokens.filter(|_| self.prefix_cache);
        self.seqs.insert(id, Seq { table, root: self.root(salt), tokens, sealed });
        id
    }

    /// A new, empty sequence whose blocks are cached under `salt` (a tenant's, say: sequences
    /// share cached blocks only with the same salt).
    pub fn new_sequence_salted(&mut self, salt: &[u8]) -> SeqId {
        self.reclaim();
        self.insert_seq(BlockTable::default(), salt, Some(Vec::new()))
    }

    /// A new sequence for `prompt` that starts on its cached prefix: returns the sequence and how
    /// many tokens it holds already (a multiple of the block size, at most `prompt.len() - 1`, 0
    /// with the cache off). Feed it `prompt[cached..]` ([`Engine::prefill`] or `step`).
    pub fn new_sequence_from_cache(&mut self, prompt: &[u32], salt: &[u8]) -> Result<(SeqId, usize)> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        Ok(self.new_sequence_with_prefix(prompt, salt, prompt.len() - 1))
    }

    /// As [`Engine::new_sequence_from_cache`], attaching at most `max_tokens` cached tokens of
    /// `tokens` (a decode worker that takes the rest by [`Engine::import_kv_onto`] may take all).
    pub fn new_sequence_with_prefix(&mut self, tokens: &[u32], salt: &[u8], max_tokens: usize) -> (SeqId, usize) {
        self.reclaim();
        let bs = self.layout.block_size;
        let root = self.root(salt);
        let mut blocks = match self.prefix_cache {
            true => self.pool.acquire_prefix(root, tokens, bs, max_tokens / bs),
            false => Vec::new(),
        };
        self.load_from_disk(root, tokens, max_tokens / bs, &mut blocks);
        let n = blocks.len() * bs;
        (self.insert_seq(BlockTable { blocks, tokens: n }, salt, Some(tokens[..n].to_vec())), n)
    }

    /// How many leading tokens of `tokens` under `salt` are cached (a multiple of the block size,
    /// up to `tokens.len()`), in the pool or after it on disk, taking nothing and counting no
    /// query.
    pub fn cached_prefix_len(&self, tokens: &[u32], salt: &[u8]) -> usize {
        if !self.prefix_cache {
            return 0;
        }
        let (bs, root) = (self.layout.block_size, self.root(salt));
        let pool = self.pool.match_prefix(root, tokens, bs);
        let disk = match (&self.disk, self.chain_end(root, &pool)) {
            (Some(d), Some(parent)) => d.chain(parent, &tokens[pool.len() * bs..], usize::MAX).len(),
            _ => 0,
        };
        (pool.len() + disk) * bs
    }

    /// The hash a chain of pool blocks `blocks` ends at (`root` when empty), where the disk
    /// tier's part of a prefix continues; None if its last block is not sealed.
    fn chain_end(&self, root: BlockHash, blocks: &[u32]) -> Option<BlockHash> {
        match blocks.last() {
            Some(&b) => self.pool.cache().hash_of(b),
            None => Some(root),
        }
    }

    /// Continue a prefix hit from disk: the blocks of `tokens` after `blocks` (the pool's hit)
    /// that the disk tier holds, up to `max_blocks` in all, are read, checked and imported into
    /// fresh blocks, sealed like computed ones and appended to `blocks`. Stops at the first block
    /// that cannot be read (a miss from there on) or when the pool has no room.
    fn load_from_disk(&mut self, root: BlockHash, tokens: &[u32], max_blocks: usize, blocks: &mut Vec<u32>) {
        let Some(disk) = &self.disk else { return };
        let bs = self.layout.block_size;
        let k = blocks.len();
        let Some(parent) = self.chain_end(root, blocks) else { return };
        let want = max_blocks.saturating_sub(k);
        let chain = disk.chain(parent, &tokens[k * bs..], want);
        if chain.is_empty() {
            return;
        }
        let Ok(fresh) = self.pool.allocate(chain.len().min(self.pool.free_count())) else { return };
        let mut parent_hash = parent;
        let mut loaded = 0;
        for (i, (&hash, &block)) in chain.iter().zip(&fresh).enumerate() {
            let chunk = &tokens[(k + i) * bs..(k + i + 1) * bs];
            let Some(payload) = disk.load(hash, parent_hash, chunk) else { break };
            let section = payload.len() / self.layout.n_layers;
            let imported = (0..self.layout.n_layers).try_for_each(|l| self.be.kv_import_layer(&mut self.kv, l, &[block], bs, &payload[l * section..(l + 1) * section]));
            if let Err(e) = imported {
                tracing::warn!("kv disk: importing block {:016x}: {e}", hash.0);
                break;
            }
            let link = match blocks.last() {
                Some(&p) => Parent::Block(p),
                None => Parent::Root(root),
            };
            if let Err(e) = self.pool.seal(block, link, chunk) {
                tracing::warn!("kv disk: sealing block {:016x} read from disk: {e}", hash.0);
                break;
            }
            blocks.push(block);
            parent_hash = hash;
            loaded += 1;
        }
        for &b in fresh[loaded..].iter().rev() {
            if let Err(e) = self.pool.release(b) {
                tracing::error!("kv disk: releasing an unused block: {e}");
            }
        }
        disk.touch(&chain[..loaded]);
        self.disk_hit_tokens += (loaded * bs) as u64;
    }

    /// A prompt that will start later (it waits in a queue, or for its KV): the blocks of its
    /// prefix that the pool lacks and the disk tier holds are read ahead now, on the tier's
    /// reader thread, so starting it takes them from memory
    /// ([`crate::kv_disk::DiskTier::prefetch`]). Returns what is being read, for
    /// [`Engine::prefetched`]; nothing without a tier.
    pub fn prefetch_prefix(&self, tokens: &[u32], salt: &[u8]) -> Prefetch {
        let Some(disk) = &self.disk else { return Prefetch::default() };
        let (bs, root) = (self.layout.block_size, self.root(salt));
        // At most all but the last token, as a prompt's start takes.
        let usable = &tokens[..tokens.len().saturating_sub(1)];
        let pool = self.pool.match_prefix(root, usable, bs);
        let Some(parent) = self.chain_end(root, &pool) else { return Prefetch::default() };
        let rest = &usable[pool.len() * bs..];
        let chain = disk.chain(parent, rest, usize::MAX);
        if !chain.is_empty() {
            disk.prefetch(parent, rest, &chain);
        }
        Prefetch { chain }
    }

    /// Whether a read ahead is over, after waiting at most `wait` for it: every block of it in
    /// memory (or found missing), so a prompt starting now waits for no disk read.
    pub fn prefetched(&self, p: &Prefetch, wait: std::time::Duration) -> bool {
        match &self.disk {
            Some(disk) => !disk.reading(&p.chain, wait),
            None => true,
        }
    }

    /// Offer sealed block `block` (hash `hash`, continuing `parent` with `tokens`) to the disk
    /// tier: its KV is copied out here and written by the tier's thread. Nothing when the tier is
    /// off or holds the block already.
    fn offer_to_disk(&self, block: u32, hash: BlockHash, parent: BlockHash, tokens: &[u32]) {
        let Some(disk) = &self.disk else { return };
        if !disk.reserve(hash) {
            return;
        }
        let t0 = std::time::Instant::now();
        let mut payload = Vec::with_capacity(disk.payload_bytes());
        let copied = (0..self.layout.n_layers).try_for_each(|l| self.be.kv_export_layer(&self.kv, l, &[block], self.layout.block_size, &mut payload));
        disk.copied(t0.elapsed());
        match copied {
            Ok(()) if payload.len() == disk.payload_bytes() => disk.offer(crate::kv_disk::Write { hash, parent, tokens: tokens.to_vec(), payload }),
            Ok(()) => {
                tracing::error!("kv disk: block {:016x} exported {} bytes, {} expected", hash.0, payload.len(), disk.payload_bytes());
                disk.unreserve(hash);
            }
            Err(e) => {
                tracing::warn!("kv disk: copying block {:016x} out: {e}", hash.0);
                disk.unreserve(hash);
            }
        }
    }

    /// The disk tier, when configured (its statistics, its blocks).
    pub fn kv_disk(&self) -> Option<&crate::kv_disk::DiskTier> {
        self.disk.as_ref()
    }

    /// Blocks written to and deleted from the disk tier since the last drain (for the routers'
    /// index of tiers); empty without one.
    pub fn drain_disk_events(&mut self) -> Vec<ferry_core::DiskEvent> {
        self.disk.as_ref().map(|d| d.drain_events()).unwrap_or_default()
    }

    /// Prompt tokens served from the disk tier since the engine was made.
    pub fn disk_hit_tokens(&self) -> u64 {
        self.disk_hit_tokens
    }

    pub fn prefix_cache_enabled(&self) -> bool {
        self.prefix_cache
    }
    /// Blocks cached with no sequence holding them (counted in [`Engine::free_blocks`] too).
    pub fn cached_blocks(&self) -> usize {
        self.pool.cached_count()
    }
    /// Blocks held by at least one sequence.
    pub fn used_blocks(&self) -> usize {
        self.pool.used_count()
    }
    pub fn cache_stats(&self) -> CacheStats {
        self.pool.cache_stats()
    }
    /// Blocks stored in and evicted from the cache since the last drain (for KV-aware routing).
    pub fn drain_cache_events(&mut self) -> Vec<CacheEvent> {
        self.pool.drain_events()
    }
    /// Test hook: index cached blocks by `hash & mask`, forcing collisions (set before any use).
    pub fn set_prefix_hash_key_mask(&mut self, mask: u64) {
        self.pool.set_hash_key_mask(mask);
    }

    /// `seq` now holds KV for `tokens` too (just computed): extend its ids and seal the blocks
    /// that are full.
    pub(super) fn record_tokens(&mut self, seq: SeqId, tokens: &[u32]) {
        let bs = self.layout.block_size;
        let Some(s) = self.seqs.get_mut(&seq) else { return };
        let Some(ids) = s.tokens.as_mut() else { return };
        ids.extend_from_slice(tokens);
        debug_assert_eq!(ids.len(), s.table.tokens, "token ids follow the table");
        // Blocks sealed here go to the disk tier after the loop (it borrows the sequence).
        let mut offers = Vec::new();
        while (s.sealed + 1) * bs <= ids.len() {
            let i = s.sealed;
            let parent = if i == 0 { Parent::Root(s.root) } else { Parent::Block(s.table.blocks[i - 1]) };
            let chunk = &ids[i * bs..(i + 1) * bs];
            match self.pool.seal(s.table.blocks[i], parent, chunk) {
                Ok(Some(hash)) if self.disk.is_some() => {
                    let parent_hash = match parent {
                        Parent::Root(r) => Some(r),
                        Parent::Block(p) => self.pool.cache().hash_of(p),
                    };
                    if let Some(ph) = parent_hash {
                        offers.push((s.table.blocks[i], hash, ph, chunk.to_vec()));
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    // A bookkeeping bug, not the request's fault: stop caching this sequence.
                    tracing::warn!(seq = seq.0, "prefix cache: {e}; the sequence's blocks will not be cached");
                    debug_assert!(false, "seal failed: {e}");
                    s.tokens = None;
                    break;
                }
            }
            s.sealed += 1;
        }
        for (block, hash, parent, chunk) in offers {
            self.offer_to_disk(block, hash, parent, &chunk);
        }
    }

    /// Import a whole payload as a new sequence whose KV is that of `tokens` under `salt`, so its
    /// full blocks are sealed and cached like computed ones.
    pub fn import_kv_with_tokens(&mut self, payload: &[u8], tokens: &[u32], salt: &[u8]) -> Result<SeqId> {
        let h = ferry_core::KvPayloadHeader::decode_checked(payload, &self.layout)?;
        self.import_payload(None, payload, KvSpan { header: h, start: 0 }, Some(tokens), salt)
    }

    /// Append a payload of the tokens from `start` on ([`Engine::export_kv_from`]) to `seq`, which
    /// must hold exactly `start` tokens (its cached prefix). `tokens` are the payload's token ids,
    /// if known (then its full blocks are cached too). Nothing changes unless it all fits.
    pub fn import_kv_onto(&mut self, seq: SeqId, payload: &[u8], tokens: Option<&[u32]>) -> Result<()> {
        let span = KvSpan::decode_checked(payload, &self.layout)?;
        self.import_payload(Some(seq), payload, span, tokens, &[]).map(|_| ())
    }

    /// As [`Engine::import_kv_onto`], with the body in a buffer ([`Engine::import_kv_buffer`]).
    pub fn import_kv_buffer_onto(&mut self, seq: SeqId, header: &[u8], body: &KvBuffer, tokens: Option<&[u32]>) -> Result<()> {
        let span = KvSpan::decode(header)?;
        self.import_buffer(Some(seq), span, body, tokens, &[]).map(|_| ())
    }

    /// As [`Engine::import_kv_with_tokens`], with the body in a buffer ([`Engine::import_kv_buffer`]).
    pub fn import_kv_buffer_with_tokens(&mut self, header: &[u8], body: &KvBuffer, tokens: &[u32], salt: &[u8]) -> Result<SeqId> {
        let h = ferry_core::KvPayloadHeader::decode(header)?;
        self.import_buffer(None, KvSpan { header: h, start: 0 }, body, Some(tokens), salt)
    }

    /// Reserve blocks for the span's tokens and fill them layer by layer with `import`; then they
    /// join `onto` (which must hold `span.start` tokens) or a new sequence (`span.start` = 0). On
    /// any failure the blocks go back and nothing changes.
    pub(super) fn import_span(
        &mut self,
        onto: Option<SeqId>,
        span: &KvSpan,
        tokens: Option<&[u32]>,
        salt: &[u8],
        mut import: impl FnMut(&B, &mut B::Kv, usize, &[u32]) -> Result<()>,
    ) -> Result<SeqId> {
        self.reclaim();
        let (n, bs, ctx) = (span.header.tokens, self.layout.block_size, self.model.config.max_position);
        if let Some(t) = tokens
            && t.len() != n
        {
            return Err(KvPayloadError::TokenCount { payload: n, given: t.len() }.into());
        }
        let holds = match onto {
            Some(id) => self.seqs.get(&id).ok_or(EngineError::UnknownSequence(id.0))?.table.tokens,
            None => 0,
        };
        if span.start != holds {
            return Err(KvPayloadError::SpanMismatch { start: span.start, holds }.into());
        }
        if !holds.is_multiple_of(bs) {
            return Err(KvPayloadError::StartNotBlockAligned { start: holds, block_size: bs }.into());
        }
        if holds + n > ctx {
            return Err(EngineError::ContextOverflow { tokens: holds + n, max_new: 0, context: ctx });
        }
        let mut fresh = BlockTable::default();
        fresh.reserve(&mut self.pool, n, bs)?;
        fresh.tokens = n;
        for l in 0..self.layout.n_layers {
            if let Err(e) = import(&self.be, &mut self.kv, l, &fresh.blocks) {
                self.pool.release_table(&mut fresh)?;
                return Err(e);
            }
        }
        let id = match onto {
            Some(id) => id,
            None => self.insert_seq(BlockTable::default(), salt, Some(Vec::new())),
        };
        let s = self.seqs.get_mut(&id).expect("checked or inserted above");
        s.table.blocks.append(&mut fresh.blocks);
        s.table.tokens += n;
        match tokens {
            Some(t) => self.record_tokens(id, t),
            None => s.tokens = None,
        }
        Ok(id)
    }

    /// A new sequence holding the same KV as `seq` (copy-on-write at fork time): its full blocks
    /// are shared (one more reference each), and its last partial block, which both will write
    /// next, is copied into a block of the new sequence's own. The new sequence caches like
    /// `seq` (same salt and token ids). Nothing changes if no block is free for the copy.
    pub fn fork(&mut self, seq: SeqId) -> Result<SeqId> {
        self.reclaim();
        let bs = self.layout.block_size;
        let s = self.seqs.get(&seq).ok_or(EngineError::UnknownSequence(seq.0))?;
        let (blocks, tokens) = (s.table.blocks.clone(), s.table.tokens);
        let (root, ids, sealed) = (s.root, s.tokens.clone(), s.sealed);
        let full = tokens / bs;
        let partial = tokens % bs;
        let mut table = BlockTable { blocks: Vec::with_capacity(blocks.len()), tokens };
        table.blocks.extend(&blocks[..full]);
        if partial > 0 {
            table.blocks.push(self.copy_block(blocks[full], partial)?);
        }
        for &b in &blocks[..full] {
            self.pool.retain(b)?;
        }
        let id = SeqId(self.next_seq);
        self.next_seq += 1;
        self.seqs.insert(id, Seq { table, root, tokens: ids, sealed });
        Ok(id)
    }

    /// A fresh block holding the first `rows` token rows of `block` (every layer, K and V).
    /// Nothing is taken if the copy fails.
    fn copy_block(&mut self, block: u32, rows: usize) -> Result<u32> {
        let copy = self.pool.allocate(1)?;
        let mut section = Vec::new();
        for l in 0..self.layout.n_layers {
            section.clear();
            let copied = self
                .be
                .kv_export_layer(&self.kv, l, &[block], rows, &mut section)
                .and_then(|()| self.be.kv_import_layer(&mut self.kv, l, &copy, rows, &section));
            if let Err(e) = copied {
                self.pool.release(copy[0])?;
                return Err(e);
            }
        }
        Ok(copy[0])
    }

    /// Cut `seq` back to its first `tokens` tokens (speculative decoding rolls back the proposed
    /// tokens it did not accept): the blocks past them go back to the pool, and the block the
    /// cut falls in, when it was sealed (drafts filled it) or is shared, is replaced by a private
    /// copy of its kept rows, since the sequence writes there next. A released sealed block
    /// stays cached: its KV is exactly that of the tokens it was sealed with. Nothing changes if
    /// that copy finds no free block.
    pub fn truncate(&mut self, seq: SeqId, tokens: usize) -> Result<()> {
        self.reclaim();
        let bs = self.layout.block_size;
        let s = self.seqs.get(&seq).ok_or(EngineError::UnknownSequence(seq.0))?;
        let held = s.table.tokens;
        if tokens > held {
            return Err(EngineError::Config(format!("cannot truncate sequence {} of {held} tokens to {tokens}", seq.0)));
        }
        if tokens == held {
            return Ok(());
        }
        let (keep, partial) = (tokens.div_ceil(bs), tokens % bs);
        let cut = (partial > 0).then(|| s.table.blocks[keep - 1]).filter(|&b| self.pool.is_sealed(b) || self.pool.ref_count(b) > 1);
        let copy = match cut {
            Some(b) => Some(self.copy_block(b, partial)?),
            None => None,
        };
        let s = self.seqs.get_mut(&seq).expect("checked above");
        let mut dropped: Vec<u32> = copy.map(|c| std::mem::replace(&mut s.table.blocks[keep - 1], c)).into_iter().collect();
        dropped.extend(s.table.blocks.drain(keep..));
        s.table.tokens = tokens;
        s.sealed = s.sealed.min(tokens / bs);
        if let Some(ids) = s.tokens.as_mut() {
            ids.truncate(tokens);
        }
        // Last block first, as `release_table` does (cached parents outlive their children).
        for b in dropped.into_iter().rev() {
            self.pool.release(b)?;
        }
        Ok(())
    }
}
