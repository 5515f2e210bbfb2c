//! Shared test support: fixture paths and the default model.
#![allow(dead_code)]

use ferry_engine::{Engine, EngineConfig};
use safetensors::SafeTensors;
use std::path::PathBuf;

pub const GOLDEN_MODELS: [&str; 4] = ["llama-gqa", "llama3-ropescaled", "qwen2-bias-tied", "llama-bf16"];

/// `tests/fixtures`, or `FERRY_FIXTURES` (a test binary carried to another machine).
pub fn fixtures() -> PathBuf {
    match std::env::var_os("FERRY_FIXTURES") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"),
    }
}

pub fn golden_dir(name: &str) -> PathBuf {
    fixtures().join("golden").join(name)
}

/// The default SmolLM2 GGUF: `FERRY_SMOLLM2_GGUF`, else fetched into the cache.
pub fn smollm2_path() -> PathBuf {
    if let Some(p) = std::env::var_os("FERRY_SMOLLM2_GGUF") {
        return PathBuf::from(p);
    }
    ferry_engine::fetch::ensure_default_model().expect("the default model is needed: run `cargo run -p ferry -- fetch`")
}

/// The device engine tests run on: `FERRY_TEST_DEVICE` (`cpu`, `cuda`, `cuda:N`), else the CPU.
pub fn test_device() -> ferry_engine::Device {
    std::env::var("FERRY_TEST_DEVICE").map(|s| s.parse().expect("FERRY_TEST_DEVICE: cpu, cuda or cuda:N")).unwrap_or_default()
}

pub fn engine(path: &std::path::Path) -> Engine {
    Engine::load(path, &EngineConfig { threads: 2, device: test_device(), ..Default::default() }).expect("load model")
}

/// A tensor from a safetensors file, converted to f64 for comparisons.
pub struct Tensors(Vec<u8>);

impl Tensors {
    pub fn open(path: PathBuf) -> Self {
        Tensors(std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
    }
    pub fn f32(&self, name: &str) -> Vec<f32> {
        let st = SafeTensors::deserialize(&self.0).unwrap();
        let t = st.tensor(name).unwrap_or_else(|_| panic!("no tensor {name}"));
        t.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
    }
    pub fn ids(&self, name: &str) -> Vec<u32> {
        let st = SafeTensors::deserialize(&self.0).unwrap();
        let t = st.tensor(name).unwrap_or_else(|_| panic!("no tensor {name}"));
        t.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32).collect()
    }
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Greedy ids via the engine's generate loop, no EOS stop (as HF `generate` in the fixtures).
pub fn greedy(engine: &mut Engine, prompt: &[u32], n: usize) -> Vec<u32> {
    let p = ferry_core::SamplingParams { ignore_eos: true, ..ferry_core::SamplingParams::greedy(n) };
    engine.generate(prompt, &p, &mut |_| {}).expect("generate").tokens
}

/// Greedy tokens for a sequence whose KV is in place, starting from `first` (its next token):
/// `n` tokens in all, one `step` each.
pub fn continue_greedy(engine: &mut Engine, seq: ferry_engine::SeqId, first: u32, n: usize) -> Vec<u32> {
    let mut out = vec![first];
    while out.len() < n {
        let item = ferry_engine::StepItem { seq, tokens: &[*out.last().unwrap()], logits: ferry_engine::Logits::Last };
        let logits = engine.step(&[item], &mut |_, _| {}).expect("decode step");
        out.push(ferry_engine::sampler::argmax(&logits[0]));
    }
    out
}

/// A fresh folder under the temp dir, removed (with what the test wrote) when dropped, so a
/// test run leaves nothing behind. Derefs to its path.
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    pub fn new(name: &str) -> ScratchDir {
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let d = std::env::temp_dir().join(format!("ferry-test-{}-{n}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        ScratchDir(d)
    }

    /// A copy of a golden model folder.
    pub fn golden_copy(name: &str, model: &str) -> ScratchDir {
        let dst = ScratchDir::new(name);
        for f in std::fs::read_dir(golden_dir(model)).unwrap() {
            let f = f.unwrap();
            std::fs::copy(f.path(), dst.join(f.file_name())).unwrap();
        }
        dst
    }
}

impl std::ops::Deref for ScratchDir {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
