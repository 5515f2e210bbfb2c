//! [`DeviceBytes`]: KV bytes in device memory (a layer gathered for export, or a payload body
//! received from a peer), the CUDA side of [`KvBuffer`](crate::backend::KvBuffer).
//!
//! Ordering: a buffer filled on the backend's stream carries an event recorded after the fill;
//! every user ([`DeviceBytes::device_ptr`], the checksum, the copy to the host) waits for it on
//! the host first, so a consumer on another stream (the NCCL pipe's) never reads a half-written
//! buffer. Users finish their own work before they return (the NCCL pipe polls its stream to
//! completion), so a buffer is never freed under a transfer still reading it. Each device has one
//! [`Kit`] (a context handle with event tracking off, a stream, the checksum kernel) shared by
//! the buffers of that device, whoever made them.
//!
//! Status: run on an H200 (2026-12-04) under the NCCL fallback and the CUDA IPC pipe.

use super::driver::{self, describe};
use super::kernels;
use super::nvrtc;
use crate::error::{EngineError, Result};
use cudarc::driver::{sys as cu, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};

/// Per device: its context, a stream for the buffers' own work, the checksum kernel.
pub(crate) struct Kit {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    checksum: CudaFunction,
}

fn err(op: &str, reason: impl std::fmt::Display) -> EngineError {
    EngineError::Cuda { op: op.into(), reason: reason.to_string() }
}

impl Kit {
    /// The kit of device `ordinal`, made on first use (the checksum kernel through NVRTC and its
    /// caches).
    pub(crate) fn for_device(ordinal: usize) -> Result<Arc<Kit>> {
        static KITS: OnceLock<Mutex<HashMap<usize, Arc<Kit>>>> = OnceLock::new();
        let mut kits = KITS.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = kits.get(&ordinal) {
            return Ok(k.clone());
        }
        let ctx = driver::open(ordinal)?;
        // SAFETY: every buffer made here is ordered by hand (the events above and host waits), so
        // cudarc's per-argument event tracking is not needed.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| err("kv buffer stream", describe(&e)))?;
        let (major, minor) = ctx.compute_capability().map_err(|e| err("compute capability", describe(&e)))?;
        let source = kernels::source_of("kv_checksum_f32").ok_or_else(|| err("kv_checksum_f32", "not in the kernel list"))?;
        let ptx = nvrtc::compile(source, &nvrtc::CompileOptions::for_arch(format!("compute_{major}{minor}")))?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)).map_err(|e| err("load kv_checksum.cu", describe(&e)))?;
        let checksum = module.load_function("kv_checksum_f32").map_err(|e| err("load kv_checksum_f32", describe(&e)))?;
        let kit = Arc::new(Kit { ordinal, ctx, stream, checksum });
        kits.insert(ordinal, kit.clone());
        Ok(kit)
    }
}

/// Little-endian bytes as 32-bit words held as f32 (KV rows of any dtype: only their bits are
/// copied; a short tail is dropped).
pub(crate) fn f32s_of(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

/// Bytes in device memory (a whole number of 32-bit words: every KV row is, held as f32 words).
pub struct DeviceBytes {
    /// At least one word (CUDA has no empty allocations); `len` says how many bytes count.
    /// Freed by `Drop` (by cudarc, or by `cuMemFree` for an exported buffer).
    buf: ManuallyDrop<CudaSlice<f32>>,
    len: usize,
    kit: Arc<Kit>,
    /// Recorded after the work that fills `buf`, on the stream that does it.
    ready: Option<CudaEvent>,
    /// Set for a buffer made by [`DeviceBytes::exportable`]: how another process opens it.
    export: Option<IpcExport>,
}

/// A buffer another process on this node can open with `cuIpcOpenMemHandle`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcExport {
    /// `cuIpcGetMemHandle` of the whole allocation.
    pub handle: [u8; 64],
    /// Unique per allocation (random), so a peer never mistakes a new buffer for one it mapped
    /// before.
    pub id: u64,
}

impl Drop for DeviceBytes {
    fn drop(&mut self) {
        // SAFETY: `buf` is taken once, here, and never used again.
        let buf = unsafe { ManuallyDrop::take(&mut self.buf) };
        let Some(export) = self.export else {
            drop(buf);
            return;
        };
        let cap = buf.len() * 4;
        let ptr = buf.leak();
        let _ = self.kit.ctx.bind_to_thread();
        // Every user of the buffer finished its device work before it let go (see the module
        // doc); the kit's own stream is waited for here.
        let _ = self.kit.stream.synchronize();
        spare::give(self.kit.ordinal, spare::Region { ptr, cap, export });
    }
}

/// Exported allocations not in use, kept for the next [`DeviceBytes::exportable`] of the same
/// device. A peer keeps the buffers it wrote into mapped, so reusing one spares the allocation,
/// its handle and the peer's `cuIpcOpenMemHandle`, which together cost more than copying the
/// bytes (first GPU run: ~17 ms per transfer, whatever its size). At most [`spare::KEEP_BYTES`]
/// per device are kept; the rest are freed.
mod spare {
    use super::{cu, IpcExport};
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};

    pub(super) const KEEP_BYTES: usize = 2 << 30;

    pub(super) struct Region {
        pub(super) ptr: cu::CUdeviceptr,
        pub(super) cap: usize,
        pub(super) export: IpcExport,
    }

    // SAFETY: a region is a device address and its export, owned by whoever holds the Region.
    unsafe impl Send for Region {}

    fn lists() -> &'static Mutex<HashMap<usize, Vec<Region>>> {
        static L: OnceLock<Mutex<HashMap<usize, Vec<Region>>>> = OnceLock::new();
        L.get_or_init(Default::default)
    }

    /// The smallest spare region of device `ordinal` that holds `len` bytes.
    pub(super) fn take(ordinal: usize, len: usize) -> Option<Region> {
        let mut l = lists().lock().unwrap_or_else(|p| p.into_inner());
        let list = l.get_mut(&ordinal)?;
        let i = (0..list.len()).filter(|&i| list[i].cap >= len).min_by_key(|&i| list[i].cap)?;
        Some(list.swap_remove(i))
    }

    /// Keep `r` for reuse; past KEEP_BYTES in all, the smallest regions are freed.
    pub(super) fn give(ordinal: usize, r: Region) {
        let freed = {
            let mut l = lists().lock().unwrap_or_else(|p| p.into_inner());
            let list = l.entry(ordinal).or_default();
            list.push(r);
            list.sort_by_key(|r| std::cmp::Reverse(r.cap));
            let mut kept = 0;
            let keep = list.iter().take_while(|r| {
                kept += r.cap;
                kept <= KEEP_BYTES
            });
            let n = keep.count();
            list.split_off(n)
        };
        for r in freed {
            free(r);
        }
    }

    pub(super) fn free(r: Region) {
        // SAFETY: `r.ptr` came from cuMemAlloc in `exportable` and only `r` owns it; the caller's
        // context is current. A peer that still maps it keeps its mapping until it closes it.
        unsafe {
            cu::cuMemFree_v2(r.ptr);
        }
    }
}

impl DeviceBytes {
    /// `len` zeroed bytes on the kit's device (`len` a multiple of 4).
    pub(crate) fn zeroed(kit: &Arc<Kit>, len: usize) -> Result<Self> {
        if !len.is_multiple_of(4) {
            return Err(err("kv buffer", format!("{len} bytes is not a whole number of 32-bit words")));
        }
        kit.ctx.bind_to_thread().map_err(|e| err("bind the context", describe(&e)))?;
        let buf = kit.stream.alloc_zeros::<f32>((len / 4).max(1)).map_err(|e| err("kv buffer", format!("cannot allocate {len} bytes: {}", describe(&e))))?;
        kit.stream.synchronize().map_err(|e| err("kv buffer", describe(&e)))?;
        Ok(DeviceBytes { buf: ManuallyDrop::new(buf), len, kit: kit.clone(), ready: None, export: None })
    }

    /// `len` bytes on device `ordinal` that another process can open through CUDA IPC
    /// ([`DeviceBytes::ipc_export`]), to be written whole by that process (not zeroed: a memset
    /// here would race the peer's copy, which no stream of this process orders). Allocated with
    /// `cuMemAlloc` (the stream-ordered pool that cudarc allocates from gives memory
    /// `cuIpcGetMemHandle` refuses), or a spare one reused (see [`spare`]).
    pub fn exportable(ordinal: usize, len: usize) -> Result<Self> {
        if !len.is_multiple_of(4) {
            return Err(err("kv buffer", format!("{len} bytes is not a whole number of 32-bit words")));
        }
        let kit = Kit::for_device(ordinal)?;
        kit.ctx.bind_to_thread().map_err(|e| err("bind the context", describe(&e)))?;
        let region = match spare::take(ordinal, len) {
            Some(r) => r,
            None => {
                // Room to grow: a power of two up to 64 MiB, whole 64 MiB steps above.
                let cap = if len <= 64 << 20 { len.max(1 << 20).next_power_of_two() } else { len.next_multiple_of(64 << 20) };
                let mut ptr: cu::CUdeviceptr = 0;
                // SAFETY: writes one device pointer; the context is bound to this thread.
                let r = unsafe { cu::cuMemAlloc_v2(&mut ptr, cap) };
                if r != cu::CUresult::CUDA_SUCCESS {
                    return Err(err("exportable kv buffer", format!("cannot allocate {cap} bytes: {r:?}")));
                }
                let mut h = cu::CUipcMemHandle { reserved: [0; 64] };
                // SAFETY: `ptr` is the base of a cuMemAlloc allocation; writes the 64-byte handle.
                let r = unsafe { cu::cuIpcGetMemHandle(&mut h, ptr) };
                let handle: [u8; 64] = std::array::from_fn(|i| h.reserved[i] as u8);
                let region = spare::Region { ptr, cap, export: IpcExport { handle, id: rand::random() } };
                if r != cu::CUresult::CUDA_SUCCESS {
                    spare::free(region);
                    return Err(err("exportable kv buffer", format!("cuIpcGetMemHandle: {r:?}")));
                }
                region
            }
        };
        // SAFETY: the region is `cap` bytes of this context's device, owned from here by the value
        // built below (its Drop gives it back to the spares).
        let buf = unsafe { kit.stream.upgrade_device_ptr::<f32>(region.ptr, region.cap / 4) };
        Ok(DeviceBytes { buf: ManuallyDrop::new(buf), len, kit: kit.clone(), ready: None, export: Some(region.export) })
    }

    /// Bytes per second the device copies from one buffer of `len` bytes to another (each byte
    /// counted once), best of 3 after a warm-up: the ceiling of a device-to-device KV transfer.
    pub fn copy_rate(ordinal: usize, len: usize) -> Result<f64> {
        let (src, mut dst) = (Self::alloc(ordinal, len)?, Self::alloc(ordinal, len)?);
        let k = src.kit.clone();
        let mut best = 0f64;
        for i in 0..4 {
            let t = std::time::Instant::now();
            k.stream.memcpy_dtod(&*src.buf, &mut *dst.buf).map_err(|e| err("copy_rate", describe(&e)))?;
            k.stream.synchronize().map_err(|e| err("copy_rate", describe(&e)))?;
            if i > 0 {
                best = best.max(len as f64 / t.elapsed().as_secs_f64());
            }
        }
        Ok(best)
    }

    /// How another process opens this buffer, if it was made by [`DeviceBytes::exportable`].
    pub fn ipc_export(&self) -> Option<IpcExport> {
        self.export
    }

    /// A buffer for `len` bytes on device `ordinal` (what a receiving pipe allocates).
    pub fn alloc(ordinal: usize, len: usize) -> Result<Self> {
        Self::zeroed(&Kit::for_device(ordinal)?, len)
    }

    /// Wrap `buf`, filled by work queued on `stream` (an event is recorded after it).
    pub(crate) fn filled(buf: CudaSlice<f32>, kit: Arc<Kit>, stream: &CudaStream) -> Result<Self> {
        let ready = stream.record_event(None).map_err(|e| err("record the kv export event", describe(&e)))?;
        Ok(DeviceBytes { len: buf.len() * 4, buf: ManuallyDrop::new(buf), kit, ready: Some(ready), export: None })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn ordinal(&self) -> usize {
        self.kit.ordinal
    }

    /// Wait (on the host) until the work that fills the buffer is done.
    pub fn wait_ready(&self) -> Result<()> {
        self.kit.ctx.bind_to_thread().map_err(|e| err("bind the context", describe(&e)))?;
        if let Some(ev) = &self.ready {
            ev.synchronize().map_err(|e| err("wait for the kv buffer", describe(&e)))?;
        }
        Ok(())
    }

    fn words(range: &Range<usize>) -> Result<Range<usize>> {
        if range.start % 4 != 0 || range.end % 4 != 0 {
            return Err(err("kv buffer", format!("bytes {}..{} are not whole 32-bit words", range.start, range.end)));
        }
        Ok(range.start / 4..range.end / 4)
    }

    /// The device address of byte `offset`, once the buffer is ready. The caller keeps `self`
    /// alive, and finishes its device work before it lets go of it.
    pub fn device_ptr(&self, offset: usize) -> Result<u64> {
        self.wait_ready()?;
        let (ptr, _guard) = self.buf.device_ptr(&self.kit.stream);
        Ok(ptr + offset as u64)
    }

    /// The device slice (for kernels of the same device), once the buffer is ready.
    pub(crate) fn slice(&self) -> Result<&CudaSlice<f32>> {
        self.wait_ready()?;
        Ok(&*self.buf)
    }

    pub(crate) fn checksum(&self, range: Range<usize>) -> Result<u32> {
        let w = Self::words(&range)?;
        self.wait_ready()?;
        let k = &self.kit;
        let mut out = k.stream.alloc_zeros::<u32>(1).map_err(|e| err("kv_checksum_f32", describe(&e)))?;
        if !w.is_empty() {
            let n = w.len() as u64;
            let words = self.buf.slice(w.clone());
            let mut b = k.stream.launch_builder(&k.checksum);
            b.arg(&words).arg(&n).arg(&mut out);
            let blocks = w.len().div_ceil(256).clamp(1, 1024) as u32;
            let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: `words` holds n 32-bit words of this device; `out` one zeroed u32.
            unsafe { b.launch(cfg) }.map_err(|e| err("kv_checksum_f32", describe(&e)))?;
        }
        let v = k.stream.clone_dtoh(&out).map_err(|e| err("kv_checksum_f32", describe(&e)))?;
        Ok(v[0])
    }

    pub(crate) fn to_host(&self, range: Range<usize>) -> Result<Vec<u8>> {
        let w = Self::words(&range)?;
        self.wait_ready()?;
        if w.is_empty() {
            return Ok(Vec::new());
        }
        let v = self.kit.stream.clone_dtoh(&self.buf.slice(w)).map_err(|e| err("copy a kv buffer to the host", describe(&e)))?;
        Ok(bytemuck::cast_slice(&v).to_vec())
    }

    pub(crate) fn write(&mut self, offset: usize, data: &[u8]) -> Result<()> {
        let w = Self::words(&(offset..offset + data.len()))?;
        self.wait_ready()?;
        if w.is_empty() {
            return Ok(());
        }
        let host = f32s_of(data);
        let mut dst = self.buf.slice_mut(w);
        self.kit.stream.memcpy_htod(host.as_slice(), &mut dst).map_err(|e| err("copy to a kv buffer", describe(&e)))?;
        self.kit.stream.synchronize().map_err(|e| err("copy to a kv buffer", describe(&e)))
    }
}
