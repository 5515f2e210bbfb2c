//! `ferry score`: logits at every position of a token sequence (safetensors in, safetensors out),
//! and the sequence's perplexity. How correctness is checked from outside.

use crate::ModelArgs;
use anyhow::Context;
use safetensors::{Dtype, SafeTensors};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct ScoreArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// A safetensors file with an i64 tensor `input_ids` of shape [T].
    #[arg(long)]
    pub tokens: PathBuf,
    /// Where to write `logits` [T, vocab] f32.
    #[arg(long)]
    pub out: PathBuf,
}

fn read_ids(path: &PathBuf) -> anyhow::Result<Vec<u32>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let st = SafeTensors::deserialize(&bytes).with_context(|| format!("{}: invalid safetensors", path.display()))?;
    let t = st.tensor("input_ids").with_context(|| format!("{}: no tensor `input_ids`", path.display()))?;
    if t.dtype() != Dtype::I64 || t.shape().len() != 1 {
        anyhow::bail!("{}: `input_ids` must be i64 of shape [T], found {:?} {:?}", path.display(), t.dtype(), t.shape());
    }
    t.data()
        .chunks_exact(8)
        .map(|b| {
            let v = i64::from_le_bytes(b.try_into().expect("8-byte chunk"));
            u32::try_from(v).map_err(|_| anyhow::anyhow!("{}: token id {v} is negative or too large", path.display()))
        })
        .collect()
}

/// exp(mean negative log-likelihood of each next token).
pub fn perplexity(logits: &[f32], ids: &[u32], vocab: usize) -> f64 {
    if ids.len() < 2 {
        return f64::NAN;
    }
    let mut nll = 0f64;
    for t in 0..ids.len() - 1 {
        let row = &logits[t * vocab..(t + 1) * vocab];
        nll += ferry_core::logprobs::log_sum_exp(row) - row[ids[t + 1] as usize] as f64;
    }
    (nll / (ids.len() - 1) as f64).exp()
}

pub fn run(a: ScoreArgs) -> anyhow::Result<()> {
    let ids = read_ids(&a.tokens)?;
    // A fidelity tool: its logits are compared with references, so the exact math by default.
    let mut engine = a.model.load(crate::ActivationsArg::Exact)?;
    let vocab = engine.config().vocab_size;
    let logits = engine.score(&ids)?;
    let shape = vec![ids.len(), vocab];
    let view = safetensors::tensor::TensorView::new(Dtype::F32, shape, bytemuck_cast(&logits))?;
    safetensors::serialize_to_file([("logits", view)], None, &a.out).with_context(|| format!("writing {}", a.out.display()))?;
    println!("{{\"tokens\": {}, \"vocab\": {}, \"perplexity\": {:.6}}}", ids.len(), vocab, perplexity(&logits, &ids, vocab));
    Ok(())
}

fn bytemuck_cast(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern is a valid u8; the slice covers exactly
    // the f32 buffer's bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}
