//! Which kernels serve a KV cache of a given dtype (`kernels/kv_cache.cu`, `kernels/attention.cu`),
//! and whether the CUDA backend can store its layout at all: rows move as 32-bit words (export,
//! import), so a row must be a whole number of words, and an int8 row's f32 scale must sit on a
//! word boundary. Plain data, present in every build, so a CPU-only test checks the choice.

use ferry_core::{KvDtype, KvLayout};

/// The kernels of one cache dtype, and the row size they move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvKernels {
    /// f32 K/V rows → stored rows (`kv_write_<dtype>`).
    pub write: &'static str,
    pub prefill: &'static str,
    pub decode: &'static str,
    /// Stored rows → dense f32 for the GEMM attention (f32 rows are copied as words).
    pub widen: &'static str,
    /// 32-bit words per stored row (`kv_gather_u32` / `kv_scatter_u32` take this).
    pub row_words: usize,
    /// The kernel that turns query and output rows into and out of the rows' basis, where the
    /// cache stores its rows turned (int8: `hadamard_rows_f32`, see `ferry_core::kv_dtype`).
    pub turn: Option<&'static str>,
}

/// The longest int8 row the turning kernels hold in shared memory (`KV_TURN_MAX` in
/// `kernels/kv_cache.cu`; the attention kernels' limit too).
pub const TURN_MAX_HEAD_DIM: usize = 256;

/// The row copies, whatever the dtype.
pub const GATHER: &str = "kv_gather_u32";
pub const SCATTER: &str = "kv_scatter_u32";

impl KvKernels {
    /// The kernels for `layout`, or why the CUDA backend cannot store it.
    pub fn for_layout(layout: &KvLayout) -> Result<KvKernels, String> {
        let (dtype, hd) = (layout.dtype, layout.head_dim);
        let row_bytes = dtype.row_bytes(hd);
        // int8: the scale follows head_dim bytes, so head_dim % 4 keeps it (and the row) aligned.
        if hd == 0 || !row_bytes.is_multiple_of(4) {
            let multiple = match dtype {
                KvDtype::F32 => 1,
                KvDtype::BF16 | KvDtype::F16 => 2,
                KvDtype::Int8 => 4,
            };
            return Err(format!("the CUDA backend moves KV rows as 32-bit words: a {dtype} row of head_dim {hd} is {row_bytes} bytes (head_dim must be a non-zero multiple of {multiple})"));
        }
        if dtype.turned() && hd > TURN_MAX_HEAD_DIM {
            return Err(format!("the CUDA backend turns {dtype} rows in shared memory: head_dim {hd} is over its {TURN_MAX_HEAD_DIM}"));
        }
        let (write, prefill, decode, widen) = match dtype {
            KvDtype::F32 => ("kv_write_f32", "paged_attention_prefill_f32", "paged_attention_decode_f32", GATHER),
            KvDtype::BF16 => ("kv_write_bf16", "paged_attention_prefill_bf16", "paged_attention_decode_bf16", "kv_widen_bf16"),
            KvDtype::F16 => ("kv_write_f16", "paged_attention_prefill_f16", "paged_attention_decode_f16", "kv_widen_f16"),
            KvDtype::Int8 => ("kv_write_int8", "paged_attention_prefill_int8", "paged_attention_decode_int8", "kv_widen_int8"),
        };
        let turn = dtype.turned().then_some("hadamard_rows_f32");
        Ok(KvKernels { write, prefill, decode, widen, row_words: row_bytes / 4, turn })
    }

    /// Whether `kv_write` runs one warp per (token, KV head) row (int8 reduces each row to its
    /// scale) rather than one thread per value.
    pub fn write_per_row(&self) -> bool {
        self.write == "kv_write_int8"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::kernels::source_of;

    fn layout(dtype: KvDtype, head_dim: usize) -> KvLayout {
        KvLayout { dtype, block_size: 16, n_layers: 1, n_kv_heads: 2, head_dim }
    }

    #[test]
    fn each_dtype_gets_its_kernels_and_row_words() {
        for (dtype, hd, words, write) in [
            (KvDtype::F32, 64, 64, "kv_write_f32"),
            (KvDtype::BF16, 64, 32, "kv_write_bf16"),
            (KvDtype::F16, 128, 64, "kv_write_f16"),
            (KvDtype::Int8, 64, 17, "kv_write_int8"),
            (KvDtype::Int8, 4, 2, "kv_write_int8"),
            (KvDtype::BF16, 2, 1, "kv_write_bf16"),
        ] {
            let k = KvKernels::for_layout(&layout(dtype, hd)).unwrap();
            assert_eq!((k.row_words, k.write), (words, write), "{dtype} head_dim {hd}");
            assert_eq!(k.write_per_row(), dtype == KvDtype::Int8);
            assert_eq!(k.turn.is_some(), dtype == KvDtype::Int8);
            for f in [k.write, k.prefill, k.decode, k.widen, GATHER, SCATTER].into_iter().chain(k.turn) {
                assert!(source_of(f).is_some(), "{f} is not in the kernel list");
            }
        }
    }

    #[test]
    fn rows_that_are_not_whole_words_are_refused() {
        for (dtype, hd) in [(KvDtype::Int8, 6), (KvDtype::Int8, 2), (KvDtype::BF16, 3), (KvDtype::F16, 5), (KvDtype::F32, 0), (KvDtype::Int8, 512)] {
            let e = KvKernels::for_layout(&layout(dtype, hd)).unwrap_err();
            assert!(e.contains(dtype.name()) && e.contains(&format!("head_dim {hd}")), "{e}");
        }
    }
}
