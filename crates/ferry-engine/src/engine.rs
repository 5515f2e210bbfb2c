//! The engine: a model, its backend and a paged KV cache, driven one step at a time.
//!
//! [`Engine::step`] is the primitive the cluster builds on: any mix of sequences, each contributing
//! a prefill chunk or decode tokens, in one forward pass (continuous batching). Sequences own block
//! tables in a [`BlockPool`]; their KV can be exported as a self-describing payload and imported
//! into another engine. [`Engine::generate`] is the single-sequence loop used by the CLI.
//!
//! With [`EngineConfig::prefix_cache`] (on by default) the engine keeps the token ids behind each
//! sequence's KV, seals every block that fills, and leaves sealed blocks cached when a sequence is
//! released, so a later prompt with the same leading blocks attaches them instead of recomputing:
//! see the [`prefix`] module for that API.

use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, BatchPlan, Device, DeviceBackend, KvBuffer, SeqPlan};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::loader::{self, LoadedModel};
use crate::model::Model;
use crate::sampler::{processors_for, Sampler};
use ferry_core::{BlockPool, BlockTable, KvDtype, KvLayout, KvPayloadHeader, KvSpan, Processors, SamplingParams};
use prefix::Seq;
use ferry_tokenizer::{ChatTemplate, TextStream, Tokenizer};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub mod prefix;
pub mod sequence;

pub use prefix::Prefetch;
pub use sequence::Sequence;

/// Steps priced against a profile's cost model ([`Engine::price`]): how many, how long they took,
/// and how long the model says the same shapes take on the profiled device.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepClock {
    pub steps: u64,
    pub seconds: f64,
    pub model_seconds: f64,
}

#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Worker threads (0 = one per core).
    pub threads: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV cache capacity in tokens (wins over `kv_memory`).
    pub kv_tokens: Option<usize>,
    /// KV cache capacity in bytes: blocks of the stored dtype that fit (so an int8 cache holds
    /// about 4x the tokens of an f32 one). None, with `kv_tokens` unset: on a GPU a fraction of
    /// its free memory (`kv_memory_fraction`), on the CPU 4 contexts, at most 2 GiB.
    pub kv_memory: Option<usize>,
    /// What the KV cache stores (see [`ferry_core::kv_dtype`]).
    pub kv_dtype: KvDtype,
    /// Most tokens one forward step processes (long prompts are prefilled in chunks of this).
    pub max_batch_tokens: usize,
    /// CPU matmul precision for quantized weights (exact f32 by default).
    pub activations: crate::backend::cpu::Activations,
    /// Where the model runs ([`Engine::load`]).
    pub device: Device,
    /// On a GPU, with `kv_tokens` unset: the fraction of the device memory still free after the
    /// weights are loaded that the KV cache takes.
    pub kv_memory_fraction: f32,
    /// Keep full blocks of released sequences cached and attach them to later prompts with the
    /// same prefix ([`Engine::new_sequence_from_cache`]). Results are unchanged either way.
    pub prefix_cache: bool,
    /// A second tier below the pool: sealed blocks written to files under a directory and read
    /// back on a prefix hit ([`crate::kv_disk`]). Needs the prefix cache.
    pub kv_disk: Option<crate::kv_disk::DiskConfig>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            threads: 0,
            block_size: 16,
            kv_tokens: None,
            kv_memory: None,
            kv_dtype: KvDtype::F32,
            max_batch_tokens: 2048,
            activations: Default::default(),
            device: Device::Cpu,
            kv_memory_fraction: 0.9,
            prefix_cache: true,
            kv_disk: None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

/// Which logits a step returns for an item.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    None,
    Last,
    All,
}

pub struct StepItem<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    pub logits: Logits,
}

use ferry_core::finish::{After, Bounds};
pub use ferry_core::finish::FinishReason;

#[derive(Clone, Debug)]
pub struct Generation {
    /// Generated ids; a stop token that ended generation is not included.
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    /// Time to first token (prefill + first sample).
    pub ttft: Duration,
    /// Time of the decode steps after the first token.
    pub decode_time: Duration,
}

impl Generation {
    /// Mean time per output token after the first.
    pub fn tpot(&self) -> Option<Duration> {
        (self.tokens.len() > 1).then(|| self.decode_time / (self.tokens.len() as u32 - 1))
    }
}

/// Read access to one layer of the cache during a forward step (for layer-wise KV streaming).
pub struct KvView<'a, B: Backend> {
    be: &'a B,
    kv: &'a B::Kv,
    block_size: usize,
    seqs: &'a HashMap<SeqId, Seq>,
}

impl<B: Backend> KvView<'_, B> {
    /// Append `layer`'s K then V for `seq` (token-contiguous) to `out`.
    pub fn export_layer(&self, seq: SeqId, layer: usize, out: &mut Vec<u8>) -> Result<()> {
        self.export_layer_from(seq, layer, 0, out)
    }

    /// As [`KvView::export_layer`], for the tokens from `start` on (a multiple of the block size:
    /// the section of a payload from [`Engine::export_kv_from`]).
    pub fn export_layer_from(&self, seq: SeqId, layer: usize, start: usize, out: &mut Vec<u8>) -> Result<()> {
        let t = &self.seqs.get(&seq).ok_or(EngineError::UnknownSequence(seq.0))?.table;
        let first = prefix::span_start_block(t, start, self.block_size)?;
        self.be.kv_export_layer(self.kv, layer, &t.blocks[first..], t.tokens - start, out)
    }

    /// `layer`'s K then V for `seq` in the backend's own memory (device memory on a GPU), for a
    /// transport that sends from there.
    pub fn export_layer_buffer(&self, seq: SeqId, layer: usize) -> Result<KvBuffer> {
        self.export_layer_buffer_from(seq, layer, 0)
    }

    /// As [`KvView::export_layer_buffer`], for the tokens from `start` on (a block boundary).
    pub fn export_layer_buffer_from(&self, seq: SeqId, layer: usize, start: usize) -> Result<KvBuffer> {
        let t = &self.seqs.get(&seq).ok_or(EngineError::UnknownSequence(seq.0))?.table;
        let first = prefix::span_start_block(t, start, self.block_size)?;
        self.be.kv_export_layer_buffer(self.kv, layer, &t.blocks[first..], t.tokens - start)
    }
}

/// One layer's section of a payload laid out as `got`, in the stored type of a cache laid out as
/// `want`: borrowed when the types agree, else converted row by row (one pass, through f32).
fn as_stored<'a>(got: &KvLayout, want: &KvLayout, section: &'a [u8]) -> Result<std::borrow::Cow<'a, [u8]>> {
    if got.dtype == want.dtype {
        return Ok(std::borrow::Cow::Borrowed(section));
    }
    ferry_core::kv_dtype::convert_rows(got.dtype, want.dtype, want.head_dim, section)
        .map(std::borrow::Cow::Owned)
        .map_err(|e| EngineError::Config(format!("KV payload in {} for a {} cache: {e}", got.dtype, want.dtype)))
}

pub struct Engine<B: Backend = DeviceBackend> {
    be: B,
    model: Model<B>,
    kv: B::Kv,
    pool: BlockPool,
    layout: KvLayout,
    seqs: HashMap<SeqId, Seq>,
    next_seq: u64,
    /// Where dropped [`Sequence`] handles send their ids ([`Engine::reclaim`]).
    returns: sequence::Returns,
    prefix_cache: bool,
    /// The disk tier below the pool, when configured ([`crate::kv_disk`]).
    disk: Option<crate::kv_disk::DiskTier>,
    /// Prompt tokens served from the disk tier so far.
    disk_hit_tokens: u64,
    max_batch_tokens: usize,
    pub tokenizer: Arc<Tokenizer>,
    pub chat_template: Option<ChatTemplate>,
    pub fingerprint: String,
    /// Whether prompts are encoded with the tokenizer's special tokens (BOS).
    pub add_special_tokens: bool,
    /// Steps take at least what this cost model says (see [`Engine::pace`]).
    pace: Option<ferry_core::profile::CostModel>,
    /// Steps are priced against this cost model (see [`Engine::price`]).
    price: Option<ferry_core::profile::CostModel>,
    clock: StepClock,
}

impl Engine<DeviceBackend> {
    /// Load a model (GGUF file or HF folder) onto `cfg.device`. The device is checked before the
    /// model is read, so a missing GPU (or a build without CUDA) fails fast with a clear error.
    pub fn load(path: &Path, cfg: &EngineConfig) -> Result<Self> {
        match cfg.device {
            Device::Cpu => {
                let mut be = CpuBackend::with_activations(cfg.threads, cfg.activations)?;
                let mut loaded = loader::load(path)?;
                if crate::backend::cpu::pack_weights(&mut loaded.weights, loaded.config.n_layers, cfg.activations == crate::backend::cpu::Activations::Q8)? {
                    be.set_all_interleaved();
                }
                Self::from_loaded(DeviceBackend::Cpu(be), loaded, cfg)
            }
            Device::Cuda(ordinal) => Self::load_cuda(path, cfg, ordinal),
        }
    }

    #[cfg(feature = "cuda")]
    fn load_cuda(path: &Path, cfg: &EngineConfig, ordinal: usize) -> Result<Self> {
        let be = crate::backend::cuda::CudaBackend::new(ordinal)?;
        let loaded = loader::load(path)?;
        Self::from_loaded(DeviceBackend::Cuda(be), loaded, cfg)
    }

    /// A build without CUDA: [`CudaBackend::new`](crate::backend::cuda::CudaBackend::new) says so.
    #[cfg(not(feature = "cuda"))]
    fn load_cuda(_path: &Path, _cfg: &EngineConfig, ordinal: usize) -> Result<Self> {
        match crate::backend::cuda::CudaBackend::new(ordinal)? {}
    }
}

impl<B: Backend> Engine<B> {
    pub fn from_loaded(be: B, m: LoadedModel, cfg: &EngineConfig) -> Result<Self> {
        if cfg.block_size == 0 || cfg.max_batch_tokens == 0 {
            return Err(EngineError::Config("block_size and max_batch_tokens must be positive".into()));
        }
        let c = &m.config;
        let layout = KvLayout { dtype: cfg.kv_dtype, block_size: cfg.block_size, n_layers: c.n_layers, n_kv_heads: c.n_kv_heads, head_dim: c.head_dim };
        let per_token = layout.bytes_per_token();
        // Weights first: on a GPU the KV cache takes a fraction of what they leave free.
        let model = Model::new(&be, m.config, m.weights)?;
        let c = &model.config;
        let kv_tokens = match (cfg.kv_tokens, cfg.kv_memory) {
            (Some(t), _) => t,
            (None, Some(bytes)) => {
                let block = per_token * cfg.block_size;
                if bytes < block {
                    return Err(EngineError::Config(format!("a KV memory of {bytes} bytes holds no block of {} tokens ({block} bytes as {})", cfg.block_size, layout.dtype)));
                }
                bytes / block * cfg.block_size
            }
            (None, None) => match be.kv_budget_bytes(cfg.kv_memory_fraction)? {
                Some(bytes) => (bytes / per_token).min(16 * c.max_position),
                None => (4 * c.max_position).min((2usize << 30) / per_token),
            }
            .max(cfg.block_size),
        };
        let num_blocks = BlockTable::blocks_for(kv_tokens, cfg.block_size);
        let kv = be.kv_alloc(&layout, num_blocks)?;
        let disk = match &cfg.kv_disk {
            Some(_) if !cfg.prefix_cache => return Err(EngineError::Config("--kv-disk keeps prefix-cache blocks: it needs the prefix cache on".into())),
            Some(d) => {
                let identity = crate::kv_disk::Identity::new(&m.fingerprint, &layout);
                Some(crate::kv_disk::DiskTier::open(d, &identity, layout.n_layers * layout.layer_bytes(layout.block_size))?)
            }
            None => None,
        };
        Ok(Self {
            be,
            model,
            kv,
            pool: BlockPool::new(num_blocks),
            layout,
            seqs: HashMap::new(),
            next_seq: 0,
            returns: Default::default(),
            prefix_cache: cfg.prefix_cache,
            disk,
            disk_hit_tokens: 0,
            max_batch_tokens: cfg.max_batch_tokens,
            tokenizer: Arc::new(m.tokenizer),
            chat_template: m.chat_template,
            fingerprint: m.fingerprint,
            add_special_tokens: m.add_special_tokens,
            pace: None,
            price: None,
            clock: StepClock::default(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.model.config
    }
    pub fn backend(&self) -> &B {
        &self.be
    }
    pub fn kv_layout(&self) -> KvLayout {
        self.layout
    }
    /// Most tokens one step processes.
    pub fn max_batch_tokens(&self) -> usize {
        self.max_batch_tokens
    }

    /// Blocks a new allocation can take: empty ones plus cached ones (reference count 0, kept for
    /// prefix hits, evicted when needed). [`Engine::cached_blocks`] counts the latter apart.
    pub fn free_blocks(&self) -> usize {
        self.pool.free_count()
    }
    pub fn total_blocks(&self) -> usize {
        self.pool.total()
    }
    /// Bytes of weights one decode step reads.
    pub fn decode_weight_bytes(&self) -> usize {
        self.model.decode_weight_bytes
    }
    pub fn active_sequences(&self) -> usize {
        self.seqs.len()
    }

    /// The token ids that end generation for `params`: its own, plus the model's EOS ids unless
    /// `ignore_eos`.
    pub fn stop_ids(&self, params: &SamplingParams) -> Vec<u32> {
        params.stop_ids(&self.eos_ids())
    }

    /// The model's end-of-sequence ids (its config's and its tokenizer's).
    pub fn eos_ids(&self) -> Vec<u32> {
        self.model.config.eos_token_ids.iter().chain(self.tokenizer.eos_ids()).copied().collect()
    }

    /// The request's logits processors for a sequence whose prompt is `prompt` (see
    /// [`ferry_core::processors`]); None when it asks for none. An id beyond the vocabulary in
    /// `logit_bias` is an error naming it.
    pub fn processors(&self, params: &SamplingParams, prompt: &[u32]) -> Result<Option<Processors>> {
        processors_for(&self.tokenizer, self.model.config.vocab_size, &self.eos_ids(), params, prompt)
    }

    /// Encode a prompt the way this model expects (BOS per the tokenizer's settings).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.tokenizer.encode(text, self.add_special_tokens)?)
    }

    /// A new, empty sequence (empty cache salt).
    pub fn new_sequence(&mut self) -> SeqId {
        self.new_sequence_salted(&[])
    }

    /// Free a sequence; its sealed full blocks stay cached (unless another sequence holds them).
    pub fn release(&mut self, seq: SeqId) -> Result<()> {
        let mut s = self.seqs.remove(&seq).ok_or(EngineError::UnknownSequence(seq.0))?;
        self.pool.release_table(&mut s.table)?;
        Ok(())
    }

    /// Tokens of KV held for `seq`.
    pub fn seq_len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seqs.get(&seq).ok_or(EngineError::UnknownSequence(seq.0))?.table.tokens)
    }

    /// Make every step last at least what `model` predicts for its shape (decode rows and their
    /// contexts, prompt chunks and what they attend): the engine then behaves, in time, like the
    /// device that was profiled, while it computes on this one. With a small model this emulates
    /// many such devices on a few cores, to try routing, planning and autoscaling at scale (the
    /// role NVIDIA Dynamo's mocker engine plays). None: steps take what they take.
    pub fn pace(&mut self, model: Option<ferry_core::profile::CostModel>) {
        self.pace = model;
    }

    /// Price every step against `model`: [`Engine::clock`] then sums how long steps took and how
    /// long the model says steps of their shapes take on the profiled device, so their ratio over
    /// any stretch of time is how fast this device runs against its profile right now (a shared
    /// machine drifts; the router's autoscaler plans with the measured ratio). A paced engine is
    /// priced against its pacing model unless given another.
    pub fn price(&mut self, model: Option<ferry_core::profile::CostModel>) {
        self.price = model;
    }

    /// The priced steps so far (all zero when nothing prices them).
    pub fn clock(&self) -> StepClock {
        self.clock
    }

    /// One forward pass over all items; returns each item's requested logits (`[rows, vocab]`
    /// flattened; empty for `Logits::None`). All-or-nothing: on error no sequence has advanced.
    pub fn step(&mut self, items: &[StepItem], on_layer: &mut (dyn FnMut(usize, &KvView<B>) + Send)) -> Result<Vec<Vec<f32>>> {
        self.reclaim();
        let (pace, price) = (self.pace, self.price.or(self.pace));
        let Some(price) = price else { return self.compute_step(items, on_layer) };
        // The step's shape before it runs: one-token items on a sequence with KV are decode rows.
        let (mut decodes, mut context, mut chunks) = (0, 0, Vec::new());
        for it in items {
            let held = self.seqs.get(&it.seq).map_or(0, |s| s.table.tokens);
            if it.tokens.len() == 1 && held > 0 {
                decodes += 1;
                context += held;
            } else {
                chunks.push((held, it.tokens.len()));
            }
        }
        let start = std::time::Instant::now();
        let out = self.compute_step(items, on_layer)?;
        if let Some(pace) = pace {
            let target = std::time::Duration::from_secs_f64(pace.step(decodes, context, &chunks));
            if let Some(rest) = target.checked_sub(start.elapsed()) {
                std::thread::sleep(rest);
            }
        }
        self.clock.steps += 1;
        self.clock.seconds += start.elapsed().as_secs_f64();
        self.clock.model_seconds += price.step(decodes, context, &chunks);
        Ok(out)
    }

    fn compute_step(&mut self, items: &[StepItem], on_layer: &mut (dyn FnMut(usize, &KvView<B>) + Send)) -> Result<Vec<Vec<f32>>> {
        let (ctx, vocab, bs) = (self.model.config.max_position, self.model.config.vocab_size, self.layout.block_size);
        for (i, it) in items.iter().enumerate() {
            let t = &self.seqs.get(&it.seq).ok_or(EngineError::UnknownSequence(it.seq.0))?.table;
            if it.tokens.is_empty() {
                return Err(EngineError::EmptyPrompt);
            }
            if t.tokens + it.tokens.len() > ctx {
                return Err(EngineError::ContextOverflow { tokens: t.tokens + it.tokens.len(), max_new: 0, context: ctx });
            }
            if let Some(&id) = it.tokens.iter().find(|&&id| id as usize >= vocab) {
                return Err(EngineError::TokenOutOfRange { id, vocab });
            }
            if items[..i].iter().any(|o| o.seq == it.seq) {
                return Err(EngineError::Config(format!("sequence {} appears twice in one step", it.seq.0)));
            }
        }
        // Reserve every item's blocks before advancing any table; if the pool runs out, give back
        // what this step took, so a failed step leaves the pool and every sequence as they were.
        let mut had = Vec::with_capacity(items.len());
        for it in items {
            let t = &mut self.seqs.get_mut(&it.seq).expect("checked above").table;
            had.push(t.blocks.len());
            if let Err(e) = t.reserve(&mut self.pool, it.tokens.len(), bs) {
                for (it, &n) in items.iter().zip(&had) {
                    let t = &mut self.seqs.get_mut(&it.seq).expect("checked above").table;
                    for b in t.blocks.drain(n..) {
                        self.pool.release(b)?;
                    }
                }
                return Err(e.into());
            }
        }
        let mut plan = BatchPlan::default();
        let mut tokens = Vec::new();
        let mut logit_rows = Vec::new();
        let mut ranges = Vec::new();
        for it in items {
            let t = &mut self.seqs.get_mut(&it.seq).expect("checked above").table;
            let (start, n, q_start) = (t.tokens, it.tokens.len(), tokens.len());
            // Shared blocks are immutable: every block this step writes is this sequence's alone
            // and unsealed (only full blocks are sealed and shared, and writes start after them).
            for &b in &t.blocks[start / bs..] {
                assert!(self.pool.ref_count(b) == 1 && !self.pool.is_sealed(b), "step would write into shared or sealed block {b}");
            }
            plan.slots.extend(t.append_slots(n, bs));
            plan.positions.extend(start as u32..(start + n) as u32);
            plan.seqs.push(SeqPlan { q_start, q_len: n, ctx_len: start + n, blocks: t.blocks.clone() });
            tokens.extend_from_slice(it.tokens);
            let first = logit_rows.len();
            match it.logits {
                Logits::None => {}
                Logits::Last => logit_rows.push(q_start + n - 1),
                Logits::All => logit_rows.extend(q_start..q_start + n),
            }
            ranges.push(first..logit_rows.len());
        }
        let (be, seqs, model, kv) = (&self.be, &self.seqs, &self.model, &mut self.kv);
        let run = be.run(move || {
            model.forward(be, kv, &tokens, &plan, &logit_rows, &mut |l, kv| on_layer(l, &KvView { be, kv, block_size: bs, seqs }))
        });
        let logits = match run {
            Ok(l) => l,
            Err(e) => {
                // A device failure: put every table back as it was before this step.
                for (it, &n) in items.iter().zip(&had) {
                    let t = &mut self.seqs.get_mut(&it.seq).expect("checked above").table;
                    t.tokens -= it.tokens.len();
                    for b in t.blocks.drain(n..) {
                        self.pool.release(b)?;
                    }
                }
                return Err(e);
            }
        };
        for it in items {
            self.record_tokens(it.seq, it.tokens);
        }
        Ok(ranges.into_iter().map(|r| logits[r.start * vocab..r.end * vocab].to_vec()).collect())
    }

    /// Prefill a whole prompt for `seq` in chunks of at most `max_batch_tokens`; returns the
    /// logits of the last prompt token. After [`Engine::new_sequence_from_cache`], pass the
    /// prompt from the cached length on: only that suffix is computed.
    pub fn prefill(&mut self, seq: SeqId, prompt: &[u32]) -> Result<Vec<f32>> {
        let chunks: Vec<&[u32]> = prompt.chunks(self.max_batch_tokens).collect();
        let mut last = Vec::new();
        for (i, chunk) in chunks.iter().enumerate() {
            let logits = if i + 1 == chunks.len() { Logits::Last } else { Logits::None };
            last = self.step(&[StepItem { seq, tokens: chunk, logits }], &mut |_, _| {})?.pop().unwrap_or_default();
        }
        Ok(last)
    }

    /// Logits `[prompt.len(), vocab]` at every position of `prompt` (a fresh sequence, freed after).
    pub fn score(&mut self, prompt: &[u32]) -> Result<Vec<f32>> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let seq = self.new_sequence();
        let mut out = Vec::with_capacity(prompt.len() * self.model.config.vocab_size);
        let mut result = Ok(());
        for chunk in prompt.chunks(self.max_batch_tokens) {
            match self.step(&[StepItem { seq, tokens: chunk, logits: Logits::All }], &mut |_, _| {}) {
                Ok(mut l) => out.append(&mut l[0]),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        self.release(seq)?;
        result.map(|_| out)
    }

    /// The whole KV of `seq` as a payload: header, then K and V per layer.
    pub fn export_kv(&self, seq: SeqId) -> Result<Vec<u8>> {
        self.export_kv_from(seq, 0)
    }

    /// The KV of `seq`'s tokens from `start` on (a multiple of the block size) as a payload: a
    /// v1 header when `start` is 0, else a v2 [`KvSpan`] header, then K and V per layer. For a
    /// receiver that holds the first `start` tokens already ([`Engine::import_kv_onto`]).
    pub fn export_kv_from(&self, seq: SeqId, start: usize) -> Result<Vec<u8>> {
        let t = &self.seqs.get(&seq).ok_or(EngineError::UnknownSequence(seq.0))?.table;
        let first = prefix::span_start_block(t, start, self.layout.block_size)?;
        let span = KvSpan { header: KvPayloadHeader { layout: self.layout, tokens: t.tokens - start }, start };
        let mut out = Vec::with_capacity(span.header_bytes() + span.header.body_bytes());
        out.extend_from_slice(&span.encode());
        for l in 0..self.layout.n_layers {
            self.be.kv_export_layer(&self.kv, l, &t.blocks[first..], t.tokens - start, &mut out)?;
        }
        Ok(out)
    }

    /// Import a payload as a new sequence. Nothing is stored unless layout, size and capacity all
    /// fit. The token ids are unknown, so the sequence's blocks are never cached
    /// ([`Engine::import_kv_with_tokens`] gives them).
    pub fn import_kv(&mut self, payload: &[u8]) -> Result<SeqId> {
        let h = KvPayloadHeader::decode_checked(payload, &self.layout)?;
        self.import_payload(None, payload, KvSpan { header: h, start: 0 }, None, &[])
    }

    /// Scatter a checked payload's body (after its header) into a new sequence or onto `onto`.
    /// A payload in another KV dtype than this cache's is converted layer by layer on the host.
    fn import_payload(&mut self, onto: Option<SeqId>, payload: &[u8], span: KvSpan, tokens: Option<&[u32]>, salt: &[u8]) -> Result<SeqId> {
        let (h, at) = (span.header, span.header_bytes());
        let per_layer = h.layout.layer_bytes(h.tokens);
        let want = self.layout;
        self.import_span(onto, &span, tokens, salt, |be, kv, l, blocks| {
            let section = &payload[at + l * per_layer..at + (l + 1) * per_layer];
            be.kv_import_layer(kv, l, blocks, h.tokens, &as_stored(&h.layout, &want, section)?)
        })
    }

    /// Import a payload whose body is in `body` (a buffer received device to device): `header`
    /// is the payload's header alone. The backend scatters each layer from the buffer where it is.
    pub fn import_kv_buffer(&mut self, header: &[u8], body: &KvBuffer) -> Result<SeqId> {
        let h = KvPayloadHeader::decode(header)?;
        self.import_buffer(None, KvSpan { header: h, start: 0 }, body, None, &[])
    }

    /// Scatter a body in a buffer into a new sequence or onto `onto`, after checking it against
    /// the header.
    fn import_buffer(&mut self, onto: Option<SeqId>, span: KvSpan, body: &KvBuffer, tokens: Option<&[u32]>, salt: &[u8]) -> Result<SeqId> {
        let h = span.header;
        if !h.layout.compatible(&self.layout) {
            return Err(ferry_core::KvPayloadError::LayoutMismatch { got: h.layout, want: self.layout }.into());
        }
        if body.len() != h.body_bytes() {
            return Err(ferry_core::KvPayloadError::SizeMismatch { got: body.len(), want: h.body_bytes() }.into());
        }
        let per_layer = h.layout.layer_bytes(h.tokens);
        let want = self.layout;
        self.import_span(onto, &span, tokens, salt, |be, kv, l, blocks| {
            let section = l * per_layer..(l + 1) * per_layer;
            if h.layout.dtype == want.dtype {
                return be.kv_import_layer_buffer(kv, l, blocks, h.tokens, body, section);
            }
            // Another dtype: through the host, converted (a device buffer is copied out first).
            let host = body.to_host(section)?;
            be.kv_import_layer(kv, l, blocks, h.tokens, &as_stored(&h.layout, &want, &host)?)
        })
    }

    /// Generate from `prompt` for one sequence, calling `on_text` with each piece of text as it
    /// becomes final. The sequence's KV is freed whatever the outcome.
    pub fn generate(&mut self, prompt: &[u32], params: &SamplingParams, on_text: &mut dyn FnMut(&str)) -> Result<Generation> {
        params.validate()?;
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let ctx = self.model.config.max_position;
        if prompt.len() >= ctx {
            return Err(EngineError::ContextOverflow { tokens: prompt.len(), max_new: params.max_tokens, context: ctx });
        }
        let (seq, cached) = self.new_sequence_from_cache(prompt, &[])?;
        let result = self.generate_seq(seq, prompt, cached, params, on_text);
        self.release(seq)?;
        result
    }

    /// Generate for `seq`, which holds the first `cached` tokens of `prompt` already.
    fn generate_seq(&mut self, seq: SeqId, prompt: &[u32], cached: usize, params: &SamplingParams, on_text: &mut dyn FnMut(&str)) -> Result<Generation> {
        let start = Instant::now();
        let stop_ids = self.stop_ids(params);
        let mut sampler = Sampler::new(params).processing(self.processors(params, prompt)?);
        let tokenizer = self.tokenizer.clone();
        let mut stream = TextStream::new(&tokenizer, params.stop_strings.clone(), params.min_tokens);
        let mut text = String::new();
        let mut tokens = Vec::new();
        let mut logits = self.prefill(seq, &prompt[cached..])?;
        let mut ttft = None;
        let mut decode_start = Instant::now();
        let bounds = Bounds { stop_ids: &stop_ids, max_tokens: params.max_tokens, prompt_tokens: prompt.len(), context: self.model.config.max_position };
        let finish = loop {
            let tok = sampler.sample(&mut logits);
            if ttft.is_none() {
                ttft = Some(start.elapsed());
                decode_start = Instant::now();
            }
            if let Some(f) = bounds.stops(tok) {
                break f;
            }
            tokens.push(tok);
            let (delta, stopped) = stream.push(tok)?;
            if !delta.is_empty() {
                on_text(&delta);
                text.push_str(&delta);
            }
            if let Some(f) = bounds.after(After { token: tok, count: tokens.len(), grammar_done: false, stop_string: stopped }) {
                break f;
            }
            logits = self.step(&[StepItem { seq, tokens: &[tok], logits: Logits::Last }], &mut |_, _| {})?.pop().unwrap_or_default();
        };
        if finish != FinishReason::StopString {
            let rest = stream.flush()?;
            on_text(&rest);
            text.push_str(&rest);
        }
        Ok(Generation {
            tokens,
            text,
            finish,
            prompt_tokens: prompt.len(),
            ttft: ttft.unwrap_or_default(),
            decode_time: decode_start.elapsed(),
        })
    }
}
