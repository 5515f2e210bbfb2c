//! Host-side weights: a typed, shaped view of tensor bytes that stay in the memory-mapped model
//! file whenever possible (copied only when a transform is needed, e.g. GGUF's Q/K row order).

use crate::error::{EngineError, Result};
use ferry_quant::WeightType;
use memmap2::Mmap;
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Clone)]
pub enum Storage {
    Mapped { map: Arc<Mmap>, offset: usize, len: usize },
    Owned(Arc<Vec<u8>>),
    /// Tensor `index` of a memory-mapped GGUF file.
    Gguf(Arc<ferry_gguf::GgufFile>, usize),
    /// Random bf16 values (a synthetic model, for benchmarks): a GPU backend generates them on
    /// the device; [`Storage::bytes`] makes them on the host the first time it is asked.
    Random(Arc<RandomBf16>),
}

impl Storage {
    pub fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped { map, offset, len } => &map[*offset..*offset + *len],
            Storage::Owned(v) => v,
            Storage::Gguf(file, i) => file.tensor_data(&file.tensors()[*i]),
            Storage::Random(r) => r.bytes(),
        }
    }
}

/// `numel` bf16 values uniform in [-scale, scale), value `i` a function of (`seed`, `i`) alone
/// ([`random_bf16`]), so the host and a GPU kernel (`fill_random_bf16`) make the same tensor.
pub struct RandomBf16 {
    pub seed: u32,
    pub scale: f32,
    pub numel: usize,
    bytes: std::sync::OnceLock<Vec<u8>>,
}

impl RandomBf16 {
    pub fn new(seed: u32, scale: f32, numel: usize) -> Self {
        RandomBf16 { seed, scale, numel, bytes: std::sync::OnceLock::new() }
    }

    fn bytes(&self) -> &[u8] {
        self.bytes.get_or_init(|| (0..self.numel).flat_map(|i| random_bf16(self.seed, i as u64, self.scale).to_le_bytes()).collect())
    }
}

/// Value `i` of a [`RandomBf16`] tensor, as bf16 bits: a 64-bit index hash (SplitMix64's
/// finalizer) of `i` and `seed`, its top 24 bits as u in [0, 1), then `scale·(2u − 1)` rounded to
/// bf16 (nearest, ties to even). The CPU oracle of `fill_random_bf16` (kernels/elementwise.cu).
pub fn random_bf16(seed: u32, i: u64, scale: f32) -> u16 {
    let mut z = i ^ ((seed as u64) << 32) ^ 0x9E37_79B9_7F4A_7C15;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    let u = (z >> 40) as f32 * (1.0 / 16_777_216.0);
    half::bf16::from_f32(scale * (2.0 * u - 1.0)).to_bits()
}

/// One tensor as stored: `shape` is row-major (`[rows, cols]` for a matrix, rows = output features).
#[derive(Clone)]
pub struct HostWeight {
    pub name: String,
    pub ty: WeightType,
    pub shape: Vec<usize>,
    pub storage: Storage,
    /// The same matrix with its rows interleaved in groups of 8 (`ferry_quant::interleave_x8`),
    /// for the CPU's 8-bit-activation decode kernel; made by [`pack_weights`] when asked.
    ///
    /// [`pack_weights`]: crate::backend::cpu::pack_weights
    pub x8: Option<Storage>,
}

impl std::fmt::Debug for HostWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {:?}", self.name, self.ty.name(), self.shape)
    }
}

impl HostWeight {
    pub fn bytes(&self) -> &[u8] {
        self.storage.bytes()
    }
    /// The stored size in bytes, from the type and shape (without touching the data).
    pub fn byte_len(&self) -> usize {
        self.ty.row_bytes(self.cols()).map_or(0, |rb| rb * self.rows())
    }
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Length of the innermost dimension.
    pub fn cols(&self) -> usize {
        self.shape.last().copied().unwrap_or(1)
    }
    pub fn rows(&self) -> usize {
        self.numel() / self.cols().max(1)
    }
    /// Bytes of one row of `cols()` elements.
    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols()).unwrap_or(0)
    }

    /// Validate that the byte length matches the type and shape (called by loaders).
    pub fn check(&self) -> Result<()> {
        let want = self.ty.row_bytes(self.cols()).map(|rb| rb * self.rows());
        match want {
            Some(w) if w == self.bytes().len() => Ok(()),
            _ => Err(EngineError::TensorShape {
                name: self.name.clone(),
                expected: self.shape.clone(),
                found: vec![self.bytes().len()],
            }),
        }
    }

    /// Exact dequantization of the whole tensor to f32.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.numel()];
        ferry_quant::dequantize(self.ty, self.bytes(), &mut out);
        out
    }

    /// A new tensor whose rows are this one's rows in the order `src_row(i)` for i in 0..rows.
    pub fn permute_rows(&self, src_row: impl Fn(usize) -> usize) -> HostWeight {
        let rb = self.row_bytes();
        let src = self.bytes();
        let mut out = Vec::with_capacity(src.len());
        for i in 0..self.rows() {
            let r = src_row(i);
            out.extend_from_slice(&src[r * rb..(r + 1) * rb]);
        }
        HostWeight { storage: Storage::Owned(Arc::new(out)), x8: None, ..self.clone() }
    }
}

/// Names of the weights the Llama-family model uses, independent of file format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightKey {
    Embed,
    FinalNorm,
    LmHead,
    AttnNorm(usize),
    Q(usize),
    K(usize),
    V(usize),
    O(usize),
    QBias(usize),
    KBias(usize),
    VBias(usize),
    OBias(usize),
    QNorm(usize),
    KNorm(usize),
    FfnNorm(usize),
    Gate(usize),
    Up(usize),
    Down(usize),
}

impl WeightKey {
    /// Every weight a model of `n_layers` layers may have, in the order a forward pass uses them.
    pub fn all(n_layers: usize) -> Vec<WeightKey> {
        use WeightKey::*;
        let mut keys = vec![Embed];
        for l in 0..n_layers {
            keys.extend([AttnNorm(l), Q(l), K(l), V(l), QBias(l), KBias(l), VBias(l), QNorm(l), KNorm(l), O(l), OBias(l), FfnNorm(l), Gate(l), Up(l), Down(l)]);
        }
        keys.extend([FinalNorm, LmHead]);
        keys
    }

    pub fn hf_name(self) -> String {
        use WeightKey::*;
        let l = |i: usize, s: &str| format!("model.layers.{i}.{s}");
        match self {
            Embed => "model.embed_tokens.weight".into(),
            FinalNorm => "model.norm.weight".into(),
            LmHead => "lm_head.weight".into(),
            AttnNorm(i) => l(i, "input_layernorm.weight"),
            Q(i) => l(i, "self_attn.q_proj.weight"),
            K(i) => l(i, "self_attn.k_proj.weight"),
            V(i) => l(i, "self_attn.v_proj.weight"),
            O(i) => l(i, "self_attn.o_proj.weight"),
            QBias(i) => l(i, "self_attn.q_proj.bias"),
            KBias(i) => l(i, "self_attn.k_proj.bias"),
            VBias(i) => l(i, "self_attn.v_proj.bias"),
            OBias(i) => l(i, "self_attn.o_proj.bias"),
            QNorm(i) => l(i, "self_attn.q_norm.weight"),
            KNorm(i) => l(i, "self_attn.k_norm.weight"),
            FfnNorm(i) => l(i, "post_attention_layernorm.weight"),
            Gate(i) => l(i, "mlp.gate_proj.weight"),
            Up(i) => l(i, "mlp.up_proj.weight"),
            Down(i) => l(i, "mlp.down_proj.weight"),
        }
    }

    pub fn gguf_name(self) -> String {
        use WeightKey::*;
        let l = |i: usize, s: &str| format!("blk.{i}.{s}");
        match self {
            Embed => "token_embd.weight".into(),
            FinalNorm => "output_norm.weight".into(),
            LmHead => "output.weight".into(),
            AttnNorm(i) => l(i, "attn_norm.weight"),
            Q(i) => l(i, "attn_q.weight"),
            K(i) => l(i, "attn_k.weight"),
            V(i) => l(i, "attn_v.weight"),
            O(i) => l(i, "attn_output.weight"),
            QBias(i) => l(i, "attn_q.bias"),
            KBias(i) => l(i, "attn_k.bias"),
            VBias(i) => l(i, "attn_v.bias"),
            OBias(i) => l(i, "attn_output.bias"),
            QNorm(i) => l(i, "attn_q_norm.weight"),
            KNorm(i) => l(i, "attn_k_norm.weight"),
            FfnNorm(i) => l(i, "ffn_norm.weight"),
            Gate(i) => l(i, "ffn_gate.weight"),
            Up(i) => l(i, "ffn_up.weight"),
            Down(i) => l(i, "ffn_down.weight"),
        }
    }
}

/// All tensors of a model, by logical key, after format-specific fixes.
#[derive(Default)]
pub struct WeightSet {
    pub tensors: HashMap<WeightKey, HostWeight>,
}

impl WeightSet {
    /// Take a weight and check its shape.
    pub fn take(&mut self, key: WeightKey, shape: &[usize]) -> Result<HostWeight> {
        let w = self.tensors.remove(&key).ok_or_else(|| EngineError::MissingTensor { name: format!("{key:?}") })?;
        if w.shape != shape {
            return Err(EngineError::TensorShape { name: w.name.clone(), expected: shape.to_vec(), found: w.shape.clone() });
        }
        Ok(w)
    }
    pub fn get(&self, key: WeightKey) -> Option<&HostWeight> {
        self.tensors.get(&key)
    }
    /// Bytes of all tensors (what one full pass over the weights reads).
    pub fn total_bytes(&self) -> usize {
        self.tensors.values().map(HostWeight::byte_len).sum()
    }
}
