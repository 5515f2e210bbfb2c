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
    /// A decode batch's keys split over several blocks per (sequence, head) (`paged_attention_split_<dtype>`,
    /// merged by [`MERGE`]).
    pub split: &'static str,
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

/// The merge of a split decode's parts, whatever the dtype (the parts are f32).
pub const MERGE: &str = "paged_attention_merge_f32";

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
        let (write, prefill, decode, split, widen) = match dtype {
            KvDtype::F32 => ("kv_write_f32", "paged_attention_prefill_f32", "paged_attention_decode_f32", "paged_attention_split_f32", GATHER),
            KvDtype::BF16 => ("kv_write_bf16", "paged_attention_prefill_bf16", "paged_attention_decode_bf16", "paged_attention_split_bf16", "kv_widen_bf16"),
            KvDtype::F16 => ("kv_write_f16", "paged_attention_prefill_f16", "paged_attention_decode_f16", "paged_attention_split_f16", "kv_widen_f16"),
            KvDtype::Int8 => ("kv_write_int8", "paged_attention_prefill_int8", "paged_attention_decode_int8", "paged_attention_split_int8", "kv_widen_int8"),
        };
        let turn = dtype.turned().then_some("hadamard_rows_f32");
        Ok(KvKernels { write, prefill, decode, split, widen, row_words: row_bytes / 4, turn })
    }

    /// Whether `kv_write` runs one warp per (token, KV head) row (int8 reduces each row to its
    /// scale) rather than one thread per value.
    pub fn write_per_row(&self) -> bool {
        self.write == "kv_write_int8"
    }
}

/// How a decode batch's attention spreads each sequence's keys over thread blocks
/// (`FERRY_CUDA_ATTENTION_SPLIT`: `auto`, `off`, or a number of keys per part).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionSplit {
    /// Split when a block per (sequence, head) would leave the SMs short of work.
    Auto,
    /// One block per (sequence, head), whatever the context.
    Off,
    /// Parts of this many keys (tests and measurements).
    Keys(usize),
}

/// Blocks a decode's attention aims to give the device, per SM (a block of 128 threads leaves
/// room for several per SM; more of them hide the KV reads' latency).
const SPLIT_BLOCKS_PER_SM: usize = 4;
/// The fewest keys a part takes under [`AttentionSplit::Auto`] (a part's fixed cost, the merge's
/// rereads of its partial, stays small against its keys).
const SPLIT_MIN_KEYS: usize = 256;
/// The most parts a sequence is split into.
pub const SPLIT_MAX_PARTS: usize = 64;

impl AttentionSplit {
    /// From `FERRY_CUDA_ATTENTION_SPLIT`'s value (unset: `Auto`).
    pub fn parse(value: Option<&str>) -> Result<AttentionSplit, String> {
        match value.map(str::trim) {
            None | Some("auto") => Ok(AttentionSplit::Auto),
            Some("off") => Ok(AttentionSplit::Off),
            Some(v) => match v.parse::<usize>() {
                Ok(n) if n > 0 => Ok(AttentionSplit::Keys(n)),
                _ => Err(format!("FERRY_CUDA_ATTENTION_SPLIT must be auto, off or a positive number of keys per part, not {v:?}")),
            },
        }
    }

    /// Keys per part for a decode batch of `blocks` (sequence, head) pairs whose longest context
    /// is `max_ctx` keys, on a device of `sms` SMs; `None`: one block per pair (no split).
    pub fn part_len(self, blocks: usize, max_ctx: usize, sms: usize) -> Option<usize> {
        let parts = match self {
            AttentionSplit::Off => 1,
            AttentionSplit::Keys(n) => max_ctx.div_ceil(n.max(1)),
            AttentionSplit::Auto => (SPLIT_BLOCKS_PER_SM * sms).div_ceil(blocks.max(1)).min(max_ctx / SPLIT_MIN_KEYS),
        }
        .min(SPLIT_MAX_PARTS);
        (parts > 1).then(|| max_ctx.div_ceil(parts))
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
            for f in [k.write, k.prefill, k.decode, k.split, MERGE, k.widen, GATHER, SCATTER].into_iter().chain(k.turn) {
                assert!(source_of(f).is_some(), "{f} is not in the kernel list");
            }
        }
    }

    #[test]
    fn decode_attention_splits_only_where_the_sms_would_starve() {
        let auto = AttentionSplit::Auto;
        // One sequence of 32 heads at 2,048 keys on 132 SMs: 528 blocks wanted, 8 parts of 256 keys.
        assert_eq!(auto.part_len(32, 2048, 132), Some(256));
        // Longer: the parts grow to fill the SMs (17 parts), not past them.
        assert_eq!(auto.part_len(32, 8192, 132), Some(482));
        // A batch of 32 sequences already gives 1,024 blocks; short contexts are not worth a part.
        assert_eq!(auto.part_len(32 * 32, 2048, 132), None);
        assert_eq!(auto.part_len(32, 300, 132), None);
        assert_eq!(auto.part_len(0, 0, 132), None);
        // Forced: parts of n keys, at most SPLIT_MAX_PARTS of them; off never splits.
        assert_eq!(AttentionSplit::Keys(16).part_len(24, 100, 132), Some(15));
        assert_eq!(AttentionSplit::Keys(16).part_len(24, 16, 132), None);
        assert_eq!(AttentionSplit::Keys(1).part_len(1, 1000, 132), Some(1000usize.div_ceil(SPLIT_MAX_PARTS)));
        assert_eq!(AttentionSplit::Off.part_len(1, 1 << 20, 132), None);
        // Every key lands in a part: parts × part_len covers the context, the last part is not empty.
        for (blocks, ctx) in [(1, 5000), (8, 1023), (32, 2049), (3, 257)] {
            for split in [auto, AttentionSplit::Keys(7), AttentionSplit::Keys(100)] {
                if let Some(len) = split.part_len(blocks, ctx, 132) {
                    let parts = ctx.div_ceil(len);
                    assert!(parts > 1 && parts <= SPLIT_MAX_PARTS && (parts - 1) * len < ctx, "{split:?} {blocks} {ctx}: {parts} parts of {len}");
                }
            }
        }
    }

    #[test]
    fn the_split_setting_is_parsed_or_refused() {
        assert_eq!(AttentionSplit::parse(None), Ok(AttentionSplit::Auto));
        assert_eq!(AttentionSplit::parse(Some("off")), Ok(AttentionSplit::Off));
        assert_eq!(AttentionSplit::parse(Some(" 512 ")), Ok(AttentionSplit::Keys(512)));
        for bad in ["0", "-3", "many", ""] {
            let e = AttentionSplit::parse(Some(bad)).unwrap_err();
            assert!(e.contains("FERRY_CUDA_ATTENTION_SPLIT"), "{e}");
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
