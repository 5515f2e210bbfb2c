//! The CUDA kernel sources (`kernels/*.cu` at the repository root, embedded at build time) and the
//! `extern "C"` functions each defines. Plain data, present in every build, so a CPU-only build
//! can still test that the list matches the sources.

/// One `.cu` file: an op family.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// File name under `kernels/`.
    pub file: &'static str,
    pub source: &'static str,
    /// The `extern "C"` kernels it defines, `<op>_<dtype>`.
    pub functions: &'static [&'static str],
}

macro_rules! kernel {
    ($file:literal, [$($f:literal),* $(,)?]) => {
        KernelSource { file: $file, source: include_str!(concat!("../../../../../kernels/", $file)), functions: &[$($f),*] }
    };
}

/// Every kernel file, in the order the backend compiles them.
pub const KERNELS: &[KernelSource] = &[
    kernel!("rms_norm.cu", ["rms_norm_f32", "add_rms_norm_f32"]),
    kernel!("rope.cu", ["rope_f32"]),
    kernel!("elementwise.cu", ["silu_mul_f32", "add_f32", "add_bias_f32", "to_bf16_f32", "to_f16_f32", "gather_rows_f32", "fill_random_bf16"]),
    kernel!("embedding.cu", ["embedding_f32", "embedding_bf16", "embedding_f16"]),
    kernel!("kv_cache.cu", ["kv_write_f32", "kv_write_bf16", "kv_write_f16", "kv_write_int8", "kv_gather_u32", "kv_scatter_u32", "kv_widen_bf16", "kv_widen_f16", "kv_widen_int8", "hadamard_rows_f32"]),
    kernel!(
        "attention.cu",
        [
            "paged_attention_prefill_f32",
            "paged_attention_prefill_bf16",
            "paged_attention_prefill_f16",
            "paged_attention_prefill_int8",
            "paged_attention_decode_f32",
            "paged_attention_decode_bf16",
            "paged_attention_decode_f16",
            "paged_attention_decode_int8",
            "paged_attention_split_f32",
            "paged_attention_split_bf16",
            "paged_attention_split_f16",
            "paged_attention_split_int8",
            "paged_attention_merge_f32",
            "causal_softmax_f32",
        ]
    ),
    kernel!("dequant.cu", ["dequant_q8_0_bf16", "dequant_q4_0_bf16", "dequant_q4_1_bf16"]),
    kernel!("gemv.cu", ["gemv_bf16", "gemv_f16"]),
    kernel!("sampling.cu", ["argmax_f32", "sample_top_p_f32"]),
    kernel!("kv_checksum.cu", ["kv_checksum_f32"]),
];

/// The file that defines `function`.
pub fn source_of(function: &str) -> Option<&'static KernelSource> {
    KERNELS.iter().find(|k| k.functions.contains(&function))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every listed function is defined `extern "C"` in its file, every `extern "C"` kernel of a
    /// file is listed, and names follow `<op>_<dtype>`.
    #[test]
    fn list_matches_sources() {
        for k in KERNELS {
            let defined: Vec<String> = k
                .source
                .split("extern \"C\"")
                .skip(1)
                .filter_map(|rest| {
                    // `__global__ void __launch_bounds__(N) name(`: drop the bounds, keep the name.
                    let mut r = rest.to_string();
                    if let Some(i) = r.find("__launch_bounds__(")
                        && let Some(j) = r[i..].find(')')
                    {
                        r.replace_range(i..i + j + 1, "");
                    }
                    let head = &r[..r.find('(')?];
                    head.contains("__global__").then(|| head.split_whitespace().last().map(str::to_string)).flatten()
                })
                .collect();
            let mut listed: Vec<String> = k.functions.iter().map(|f| f.to_string()).collect();
            let mut found = defined;
            listed.sort();
            found.sort();
            assert_eq!(listed, found, "{}: listed kernels vs extern \"C\" __global__ definitions", k.file);
            for f in k.functions {
                let dtype = f.rsplit('_').next().unwrap_or("");
                // u32: 32-bit words of any type (the KV row copies).
                assert!(["f32", "bf16", "f16", "int8", "u32"].contains(&dtype), "{f}: name must end in its dtype");
            }
        }
    }
}
