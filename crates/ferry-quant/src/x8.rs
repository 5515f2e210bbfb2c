//! Eight weight rows interleaved, for the 8-bit-activation decode kernel.
//!
//! In the row layout (`crate::q8`), every block of every row pays for its own integer-to-float
//! conversion, scale multiply and accumulate, and these — not memory — bound the decode kernel on
//! AVX2. Interleaving eight rows puts one row in each 32-bit lane of a vector: one `vpmaddubsw`
//! then multiplies 4 weights of each of 8 rows with the same 4 activations (broadcast), the
//! integer sums of a whole block stay in 16-bit lanes, and the conversion, scale and accumulate
//! run once per block for all eight rows. (ik_llama.cpp and llamafile repack for the same reason.)
//!
//! Layout of one group of 8 rows: per block `b` of 32 elements, the 8 rows' `f16` scales `d`
//! (16 bytes), for `Q4_1` their `f16` mins `m` (16 bytes), then the quants as 32-byte slices
//! `g`, each holding bytes `4g..4g + 4` of the 8 rows' quant bytes (row `r` at bytes
//! `4r..4r + 4`): four slices for `Q4_0`/`Q4_1` (16 quant bytes a row; byte `j` holds element `j`
//! in its low nibble and element `j + 16` in its high nibble, as in the row layout), eight for
//! `Q8_0` (32 signed bytes a row, one element each). The group is exactly as large as its 8
//! rows in the row layout, and a matrix is its groups in row order.
//!
//! Results: per row, `Σ_b fma(Σ n q, d_w d_x, ·)` and the min term `Σ_b fma(c_w, s_x, ·)`
//! accumulated separately and added at the end (`c_w = m_w` for `Q4_1`; `-8 d_w` folded in as a
//! final `fma(-8, ·, ·)` for `Q4_0`; none for `Q8_0`). An activation row's result does not depend
//! on the other rows of the batch: batched decode gives each sequence the bits it gets alone.
//! The scalar kernel here does exactly these operations, so the AVX2 kernel, and the AVX-512
//! VNNI one that does its integer sums with `vpdpbusd` (`avx512/x8.rs`), match it bit for bit;
//! against [`dot_many_q8`](crate::dot_many_q8) the sums are the same but summed in another order.

use crate::SimdLevel;
use crate::q8::Q8Activations;
use crate::types::{QK, WeightType, f16_to_f32, le_u16};

/// Rows per group.
pub const X8_ROWS: usize = 8;

/// Whether [`interleave_x8`] and [`dot_x8_q8`] support this type (`Q4_0`, `Q4_1`, `Q8_0`).
pub fn supports_x8(ty: WeightType) -> bool {
    matches!(ty, WeightType::Q4_0 | WeightType::Q4_1 | WeightType::Q8_0)
}

/// Bytes of the scale (and min) header of one block of a group.
pub(crate) fn header_bytes(ty: WeightType) -> usize {
    match ty {
        WeightType::Q4_1 => 4 * X8_ROWS,
        _ => 2 * X8_ROWS,
    }
}

/// Rewrite `src` (whole rows of `k` elements of type `ty`, a multiple of 8 rows) into `dst`
/// (the same length) in the interleaved layout.
///
/// # Panics
/// If `ty` is not supported, `k` is not a positive multiple of 32, or the lengths do not make
/// whole groups of 8 rows (caller bugs).
pub fn interleave_x8(ty: WeightType, src: &[u8], k: usize, dst: &mut [u8]) {
    assert!(supports_x8(ty), "ferry_quant::interleave_x8: weight type {ty} is not supported");
    let rb = ty.row_bytes(k).filter(|&rb| rb > 0).expect("ferry_quant::interleave_x8: k is a positive multiple of 32");
    assert!(src.len().is_multiple_of(rb * X8_ROWS) && dst.len() == src.len(), "ferry_quant::interleave_x8: {} bytes are not whole groups of 8 rows of {rb} bytes", src.len());
    let (bb, hb) = (ty.block_bytes(), header_bytes(ty));
    let qoff = hb / X8_ROWS; // a row's block: its f16 d (and m), then its quants
    let slices = (bb - qoff) / 4;
    for (g_src, g_dst) in src.chunks_exact(rb * X8_ROWS).zip(dst.chunks_exact_mut(rb * X8_ROWS)) {
        for (b, out) in g_dst.chunks_exact_mut(bb * X8_ROWS).enumerate() {
            for r in 0..X8_ROWS {
                let blk = &g_src[r * rb + b * bb..r * rb + (b + 1) * bb];
                // Header field f (d, then m) of row r at 2 (8 f + r).
                for f in 0..qoff / 2 {
                    let o = 2 * (X8_ROWS * f + r);
                    out[o..o + 2].copy_from_slice(&blk[2 * f..2 * f + 2]);
                }
                for g in 0..slices {
                    let o = hb + 32 * g + 4 * r;
                    out[o..o + 4].copy_from_slice(&blk[qoff + 4 * g..qoff + 4 * g + 4]);
                }
            }
        }
    }
}

/// Where an interleaved kernel writes: activation row `i`'s output for weight row `c` at
/// `i * ld + c` from a base, `rows × cols` outputs in all. Either a whole contiguous slice
/// ([`Outputs::contiguous`]), or a window of columns of a larger matrix ([`Outputs::strided`]),
/// so that tasks that each own some columns of every row write their results in place.
pub struct Outputs<'a> {
    ptr: *mut f32,
    rows: usize,
    ld: usize,
    cols: usize,
    _out: std::marker::PhantomData<&'a mut [f32]>,
}

impl<'a> Outputs<'a> {
    /// `out` as `rows` runs of `out.len() / rows` outputs.
    ///
    /// # Panics
    /// If `out` is not whole runs.
    pub fn contiguous(out: &'a mut [f32], rows: usize) -> Outputs<'a> {
        assert!(rows == 0 || out.len().is_multiple_of(rows), "ferry_quant::dot_x8_q8: {} outputs are not whole groups of runs for {rows} activation rows", out.len());
        let cols = out.len().checked_div(rows).unwrap_or(0);
        Outputs { ptr: out.as_mut_ptr(), rows, ld: cols, cols, _out: std::marker::PhantomData }
    }

    /// `rows` runs of `cols` outputs, run `i` at `ptr + i * ld`.
    ///
    /// # Safety
    /// For `'a`, every `ptr + i * ld + c` (`i < rows`, `c < cols`, `cols <= ld` unless one row)
    /// is valid `f32` memory that nothing else reads or writes (other windows of the same matrix
    /// may be written meanwhile: they are other columns).
    pub unsafe fn strided(ptr: *mut f32, rows: usize, ld: usize, cols: usize) -> Outputs<'a> {
        Outputs { ptr, rows, ld, cols, _out: std::marker::PhantomData }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Outputs `c..c + len` of run `i`.
    ///
    /// # Panics
    /// Outside the window.
    #[inline]
    pub(crate) fn run(&mut self, i: usize, c: usize, len: usize) -> &mut [f32] {
        assert!(i < self.rows && c + len <= self.cols, "ferry_quant: outputs {c}..{} of run {i} of a {}x{} window", c + len, self.rows, self.cols);
        // SAFETY: inside the window (asserted), which the constructor's contract makes valid and
        // this value's own for 'a; the borrow of self keeps the slice unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(i * self.ld + c), len) }
    }

    /// The window of columns `c..` (the same rows).
    pub(crate) fn from_col(&mut self, c: usize) -> Outputs<'_> {
        assert!(c <= self.cols, "ferry_quant: column {c} of a window of {}", self.cols);
        // SAFETY: a sub-window of this one, borrowed from it.
        Outputs { ptr: unsafe { self.ptr.add(c) }, rows: self.rows, ld: self.ld, cols: self.cols - c, _out: std::marker::PhantomData }
    }
}

/// `out[i * n + r]` = weight row `r` · activation row `i` of `xq`, for the interleaved rows `w`
/// (`n = out.len() / xq.rows()` rows, a multiple of 8): one run of `n` outputs per activation
/// row, as a matmul's output rows are laid out. Each group of 8 weight rows is
/// read from memory once and runs against every activation row from the L1 cache (batched
/// decode). Uses the kernels of [`SimdLevel::selected`].
///
/// # Panics
/// On inconsistent lengths or an unsupported type (caller bugs).
pub fn dot_x8_q8(ty: WeightType, w: &[u8], xq: &Q8Activations, out: &mut [f32]) {
    dot_x8_q8_at(SimdLevel::selected(), ty, w, xq, out);
}

/// [`dot_x8_q8`] into a window of a larger output ([`Outputs::strided`]): run `i` of `out` gets
/// activation row `i`'s outputs for the weight rows of `w`, in place.
///
/// # Panics
/// As [`dot_x8_q8`]: the window must be `xq.rows()` runs of exactly the rows `w` holds.
pub fn dot_x8_q8_into(ty: WeightType, w: &[u8], xq: &Q8Activations, out: &mut Outputs<'_>) {
    check_x8(ty, w, xq, out);
    run(X8Kernel::chosen(SimdLevel::selected(), xq.rows()), ty, w, xq, out);
}

/// [`dot_x8_q8`] with the kernels of a given level (`Avx512` takes the AMX kernel from
/// [`X8Kernel::chosen`]'s row count where the CPU has AMX-INT8, else the AVX-512 VNNI kernel
/// where it has VNNI, else the AVX2 kernel; all are bit-identical).
///
/// # Panics
/// As [`dot_x8_q8`], and if `level` is not supported by this CPU.
pub fn dot_x8_q8_with(level: SimdLevel, ty: WeightType, w: &[u8], xq: &Q8Activations, out: &mut [f32]) {
    assert!(level.is_supported(), "ferry_quant::dot_x8_q8: SIMD level {} not supported by this CPU", level.name());
    dot_x8_q8_at(level, ty, w, xq, out);
}

/// The kernels behind [`dot_x8_q8`], bit-identical to each other, for measuring and testing them
/// side by side ([`dot_x8_q8_by`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum X8Kernel {
    /// The reference.
    Scalar,
    /// AVX2 + FMA + F16C (`vpmaddubsw`).
    Avx2,
    /// AVX-512 VNNI on 256-bit vectors (`vpdpbusd`).
    Vnni,
    /// AMX-INT8 tiles for the integer sums, AVX-512 for the rest (`avx512/amx.rs`).
    Amx,
}

impl X8Kernel {
    /// Every kernel, slowest first.
    pub const ALL: [X8Kernel; 4] = [X8Kernel::Scalar, X8Kernel::Avx2, X8Kernel::Vnni, X8Kernel::Amx];

    /// "scalar", "avx2", "avx512-vnni" or "amx".
    pub fn name(self) -> &'static str {
        match self {
            X8Kernel::Scalar => "scalar",
            X8Kernel::Avx2 => "avx2",
            X8Kernel::Vnni => "avx512-vnni",
            X8Kernel::Amx => "amx",
        }
    }

    /// Whether this CPU (and, for AMX, the OS's grant of the tile state) can run it.
    /// `FERRY_QUANT_AMX=off` makes AMX unsupported.
    pub fn is_supported(self) -> bool {
        match self {
            X8Kernel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            X8Kernel::Avx2 => SimdLevel::Avx2.is_supported(),
            #[cfg(target_arch = "x86_64")]
            X8Kernel::Vnni => crate::avx512::x8::supported(),
            #[cfg(target_arch = "x86_64")]
            X8Kernel::Amx => crate::avx512::amx::supported(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The kernel [`dot_x8_q8_with`] runs at `level` (a supported one) for `m` activation rows:
    /// AMX from `MIN_ROWS` (12) rows up, where its tiles pay for their set-up.
    pub fn chosen(level: SimdLevel, m: usize) -> X8Kernel {
        match level {
            SimdLevel::Scalar => X8Kernel::Scalar,
            SimdLevel::Avx2 => X8Kernel::Avx2,
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 if m >= crate::avx512::amx::MIN_ROWS && X8Kernel::Amx.is_supported() => X8Kernel::Amx,
            SimdLevel::Avx512 if X8Kernel::Vnni.is_supported() => X8Kernel::Vnni,
            SimdLevel::Avx512 => X8Kernel::Avx2,
        }
    }
}

/// [`dot_x8_q8`] with a given kernel.
///
/// # Panics
/// As [`dot_x8_q8`], and if `kernel` is not supported here.
pub fn dot_x8_q8_by(kernel: X8Kernel, ty: WeightType, w: &[u8], xq: &Q8Activations, out: &mut [f32]) {
    assert!(kernel.is_supported(), "ferry_quant::dot_x8_q8: the {} kernel is not supported here", kernel.name());
    let mut out = Outputs::contiguous(out, xq.rows());
    check_x8(ty, w, xq, &out);
    run(kernel, ty, w, xq, &mut out);
}

fn dot_x8_q8_at(level: SimdLevel, ty: WeightType, w: &[u8], xq: &Q8Activations, out: &mut [f32]) {
    let mut out = Outputs::contiguous(out, xq.rows());
    check_x8(ty, w, xq, &out);
    run(X8Kernel::chosen(level, xq.rows()), ty, w, xq, &mut out);
}

/// The caller's shapes: a run of outputs per activation row, as many outputs per run as `w` holds
/// weight rows, whole groups of 8.
fn check_x8(ty: WeightType, w: &[u8], xq: &Q8Activations, out: &Outputs<'_>) {
    assert!(supports_x8(ty), "ferry_quant::dot_x8_q8: weight type {ty} is not supported");
    let m = xq.rows();
    assert!(m > 0, "ferry_quant::dot_x8_q8: no activation rows");
    let rb = ty.row_bytes(xq.k()).expect("k is a multiple of 32");
    assert!(
        out.rows() == m && out.cols().is_multiple_of(X8_ROWS) && w.len() == out.cols() * rb,
        "ferry_quant::dot_x8_q8: {} weight bytes into a {}x{} window are not whole groups of 8 rows of {rb} bytes for {m} activation rows",
        w.len(),
        out.rows(),
        out.cols()
    );
}

/// Run a supported kernel on checked lengths: activation row `i`'s outputs in run `i` of `out`.
fn run(kernel: X8Kernel, ty: WeightType, w: &[u8], xq: &Q8Activations, out: &mut Outputs<'_>) {
    match kernel {
        X8Kernel::Scalar => dot_x8_scalar(ty, w, xq, out),
        #[cfg(target_arch = "x86_64")]
        X8Kernel::Amx => {
            // SAFETY: the caller's kernel is supported (the CPU and the tile permission); the
            // lengths were checked.
            unsafe { crate::avx512::amx::dot(ty, w, xq, out) }
        }
        #[cfg(target_arch = "x86_64")]
        X8Kernel::Vnni => {
            // SAFETY: as above, for AVX-512 VNNI.
            unsafe { crate::avx512::x8::dot(ty, w, xq, out) }
        }
        #[cfg(target_arch = "x86_64")]
        X8Kernel::Avx2 => {
            // SAFETY: as above, for AVX2, FMA and F16C.
            unsafe { crate::avx2::x8::dot(ty, w, xq, out) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("not supported on this architecture"),
    }
}

/// The reference: the AVX2 kernel's operations, one lane at a time.
fn dot_x8_scalar(ty: WeightType, w: &[u8], xq: &Q8Activations, out: &mut Outputs<'_>) {
    let (nb, m) = (xq.k() / QK, xq.rows());
    let (bb, hb) = (ty.block_bytes() * X8_ROWS, header_bytes(ty));
    for (gi, group) in w.chunks_exact(bb * nb).enumerate() {
        for ri in 0..X8_ROWS * m {
            let (r, i) = (ri / m, ri % m);
            let o = &mut out.run(i, gi * X8_ROWS + r, 1)[0];
            let (q, d, s) = (&xq.quants()[i * nb * QK..], &xq.scales()[i * nb..], &xq.sums()[i * nb..]);
            let (mut acc, mut macc) = (0f32, 0f32);
            for b in 0..nb {
                let blk = &group[b * bb..(b + 1) * bb];
                let x = &q[b * QK..(b + 1) * QK];
                let mut isum = 0i32;
                if ty == WeightType::Q8_0 {
                    for g in 0..8 {
                        for j in 0..4 {
                            isum += i32::from(blk[hb + 32 * g + 4 * r + j] as i8) * i32::from(x[4 * g + j]);
                        }
                    }
                } else {
                    for g in 0..4 {
                        for j in 0..4 {
                            let byte = blk[hb + 32 * g + 4 * r + j];
                            isum += i32::from(byte & 0x0F) * i32::from(x[4 * g + j]) + i32::from(byte >> 4) * i32::from(x[16 + 4 * g + j]);
                        }
                    }
                }
                let dw = f16_to_f32(le_u16(blk, 2 * r));
                acc = (isum as f32).mul_add(dw * d[b], acc);
                if ty == WeightType::Q8_0 {
                    continue;
                }
                let c = if ty == WeightType::Q4_1 { f16_to_f32(le_u16(blk, 2 * X8_ROWS + 2 * r)) } else { dw };
                macc = c.mul_add(s[b], macc);
            }
            *o = match ty {
                WeightType::Q4_1 => acc + macc,
                WeightType::Q4_0 => (-8f32).mul_add(macc, acc),
                _ => acc,
            };
        }
    }
}
