//! The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) as one decoder written once against the
//! [`Backend`] trait: pre-norm blocks of GQA attention with RoPE and a SwiGLU MLP; Qwen2 adds q/k/v
//! biases, Qwen3 a per-head RMSNorm on q and k.

use crate::backend::{Backend, BatchPlan, RopeTable};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::weights::{WeightKey, WeightSet};

struct Layer<B: Backend> {
    attn_norm: B::Weight,
    q: B::Weight,
    k: B::Weight,
    v: B::Weight,
    o: B::Weight,
    q_bias: Option<B::Weight>,
    k_bias: Option<B::Weight>,
    v_bias: Option<B::Weight>,
    o_bias: Option<B::Weight>,
    q_norm: Option<B::Weight>,
    k_norm: Option<B::Weight>,
    ffn_norm: B::Weight,
    gate: B::Weight,
    up: B::Weight,
    down: B::Weight,
}

pub struct Model<B: Backend> {
    pub config: ModelConfig,
    embed: B::Weight,
    /// None when tied to the embedding.
    lm_head: Option<B::Weight>,
    final_norm: B::Weight,
    layers: Vec<Layer<B>>,
    rope: RopeTable,
    /// Bytes of weights read by one decode step (every matrix once, the embedding row aside).
    pub decode_weight_bytes: usize,
}

/// Reusable activation buffers for one forward step.
struct Scratch<B: Backend> {
    x: B::Tensor,
    h: B::Tensor,
    q: B::Tensor,
    k: B::Tensor,
    v: B::Tensor,
    attn: B::Tensor,
    o: B::Tensor,
    gate: B::Tensor,
    up: B::Tensor,
}

impl<B: Backend> Model<B> {
    pub fn new(be: &B, config: ModelConfig, mut w: WeightSet) -> Result<Self> {
        let c = &config;
        let (hid, q_dim, kv_dim, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let bytes = std::cell::Cell::new(0usize);
        let up = |key: WeightKey, shape: &[usize], w: &mut WeightSet| -> Result<B::Weight> {
            let t = w.take(key, shape)?;
            if shape.len() == 2 {
                bytes.set(bytes.get() + t.byte_len());
            }
            be.upload(&t)
        };
        let opt = |key: WeightKey, shape: &[usize], present: bool, w: &mut WeightSet| -> Result<Option<B::Weight>> {
            if present { Ok(Some(be.upload(&w.take(key, shape)?)?)) } else { Ok(None) }
        };
        let mut layers = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            use WeightKey::*;
            layers.push(Layer {
                attn_norm: up(AttnNorm(l), &[hid], &mut w)?,
                q: up(Q(l), &[q_dim, hid], &mut w)?,
                k: up(K(l), &[kv_dim, hid], &mut w)?,
                v: up(V(l), &[kv_dim, hid], &mut w)?,
                o: up(O(l), &[hid, q_dim], &mut w)?,
                q_bias: opt(QBias(l), &[q_dim], c.qkv_bias, &mut w)?,
                k_bias: opt(KBias(l), &[kv_dim], c.qkv_bias, &mut w)?,
                v_bias: opt(VBias(l), &[kv_dim], c.qkv_bias, &mut w)?,
                o_bias: opt(OBias(l), &[hid], c.o_bias, &mut w)?,
                q_norm: opt(QNorm(l), &[c.head_dim], c.qk_norm, &mut w)?,
                k_norm: opt(KNorm(l), &[c.head_dim], c.qk_norm, &mut w)?,
                ffn_norm: up(FfnNorm(l), &[hid], &mut w)?,
                gate: up(Gate(l), &[ff, hid], &mut w)?,
                up: up(Up(l), &[ff, hid], &mut w)?,
                down: up(Down(l), &[hid, ff], &mut w)?,
            });
        }
        let tied = c.tie_embeddings || w.get(WeightKey::LmHead).is_none();
        let embed_w = w.take(WeightKey::Embed, &[c.vocab_size, hid])?;
        let embed = be.upload(&embed_w)?;
        let lm_head = if tied {
            bytes.set(bytes.get() + embed_w.byte_len());
            None
        } else {
            Some(up(WeightKey::LmHead, &[c.vocab_size, hid], &mut w)?)
        };
        let final_norm = up(WeightKey::FinalNorm, &[hid], &mut w)?;
        let rope = RopeTable::new(&c.rope, c.head_dim);
        Ok(Self { config, embed, lm_head, final_norm, layers, rope, decode_weight_bytes: bytes.get() })
    }

    fn scratch(&self, be: &B, n: usize) -> Scratch<B> {
        let c = &self.config;
        Scratch {
            x: be.tensor(n, c.hidden_size),
            h: be.tensor(n, c.hidden_size),
            q: be.tensor(n, c.q_dim()),
            k: be.tensor(n, c.kv_dim()),
            v: be.tensor(n, c.kv_dim()),
            attn: be.tensor(n, c.q_dim()),
            o: be.tensor(n, c.hidden_size),
            gate: be.tensor(n, c.intermediate_size),
            up: be.tensor(n, c.intermediate_size),
        }
    }

    /// Run one step over `tokens` (laid out by `plan`), writing their K/V into `kv`, and return the
    /// logits `[logit_rows.len(), vocab]` of the requested rows. `on_layer(l)` runs after layer
    /// `l`'s K/V is in the cache (a prefill worker streams that layer out while the rest computes).
    pub fn forward(
        &self,
        be: &B,
        kv: &mut B::Kv,
        tokens: &[u32],
        plan: &BatchPlan,
        logit_rows: &[usize],
        on_layer: &mut dyn FnMut(usize, &B::Kv),
    ) -> Vec<f32> {
        let c = &self.config;
        let n = tokens.len();
        let batch = be.prepare(plan, &self.rope);
        let mut s = self.scratch(be, n);
        be.embed(&self.embed, tokens, &mut s.x);
        if let Some(first) = self.layers.first() {
            be.rms_norm(&s.x, &first.attn_norm, c.rms_eps, &mut s.h);
        }
        for (l, w) in self.layers.iter().enumerate() {
            // s.h holds this layer's attention norm of s.x (the previous layer's last add made it).
            be.matmul(
                &s.h,
                &[(&w.q, w.q_bias.as_ref()), (&w.k, w.k_bias.as_ref()), (&w.v, w.v_bias.as_ref())],
                &mut [&mut s.q, &mut s.k, &mut s.v],
            );
            if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
                be.head_rms_norm(&mut s.q, qn, c.head_dim, c.rms_eps);
                be.head_rms_norm(&mut s.k, kn, c.head_dim, c.rms_eps);
            }
            be.rope_qk(&mut s.q, &mut s.k, &batch, c.head_dim);
            be.kv_write(kv, l, &s.k, &s.v, &batch);
            be.attention(&s.q, kv, l, &batch, &mut s.attn);
            be.matmul(&s.attn, &[(&w.o, w.o_bias.as_ref())], &mut [&mut s.o]);
            be.add_rms_norm(&mut s.x, &s.o, &w.ffn_norm, c.rms_eps, &mut s.h);
            be.matmul(&s.h, &[(&w.gate, None), (&w.up, None)], &mut [&mut s.gate, &mut s.up]);
            be.silu_mul(&mut s.gate, &s.up);
            be.matmul(&s.gate, &[(&w.down, None)], &mut [&mut s.o]);
            match self.layers.get(l + 1) {
                Some(next) => be.add_rms_norm(&mut s.x, &s.o, &next.attn_norm, c.rms_eps, &mut s.h),
                None => be.add(&mut s.x, &s.o),
            }
            on_layer(l, kv);
        }
        if logit_rows.is_empty() {
            return Vec::new();
        }
        let sel = be.gather_rows(&s.x, logit_rows);
        let mut normed = be.tensor(logit_rows.len(), c.hidden_size);
        be.rms_norm(&sel, &self.final_norm, c.rms_eps, &mut normed);
        let mut logits = be.tensor(logit_rows.len(), c.vocab_size);
        be.matmul(&normed, &[(self.lm_head.as_ref().unwrap_or(&self.embed), None)], &mut [&mut logits]);
        be.to_host(&logits)
    }
}
