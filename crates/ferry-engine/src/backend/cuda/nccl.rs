//! A two-rank NCCL communicator used as an ordered message pipe between a prefill and a decode
//! worker's GPUs (the KV transport `nccl`; the protocol on top is `ferry-worker`'s `kv::pipe`).
//!
//! Nothing here may hang or panic: libnccl is checked for before its first call (cudarc's
//! dynamic loading panics on a missing library); the communicator is created *non-blocking* so
//! its set-up can be abandoned at a deadline; every send and receive is polled to completion
//! against a deadline, and on expiry the communicator is aborted (which also releases the
//! kernels waiting in it). Host messages (frame headers, control bodies) are staged through one
//! device buffer of the pipe's capacity; KV goes straight from and to [`DeviceBytes`]
//! ([`NcclPipe::send_device`], [`NcclPipe::recv_device`]).
//!
//! Status: on one H200 (2026-12-04) the rendezvous failed as it must (two ranks on one device,
//! `ncclInvalidUsage`) and the transfer fell back to TCP, after the full connect timeout; a
//! transfer between two GPUs has not run yet.

use super::bytes::DeviceBytes;
use super::driver;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, sys as cu};
use cudarc::nccl::sys as nc;
use std::sync::Arc;
use std::time::{Duration, Instant};

type R<T> = std::result::Result<T, String>;

/// A readable NCCL result.
fn describe(r: nc::ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString returns a static C string for any result code.
    unsafe {
        let p = nc::ncclGetErrorString(r);
        if p.is_null() {
            format!("{r:?}")
        } else {
            format!("{r:?} ({})", std::ffi::CStr::from_ptr(p).to_string_lossy())
        }
    }
}

/// Is libnccl loadable? (Before any other call here.)
pub fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen the library by name.
    unsafe { nc::is_culib_present() }
}

/// A fresh `ncclUniqueId` (rank 0 makes it and sends it to rank 1 over gRPC).
pub fn unique_id() -> R<Vec<u8>> {
    if !nccl_present() {
        return Err("libnccl.so could not be loaded (install NCCL; with the nvidia-nccl-cu12 wheel, link libnccl.so to its lib/libnccl.so.2 and put both on LD_LIBRARY_PATH)".into());
    }
    let mut id = nc::ncclUniqueId { internal: [0; 128] };
    // SAFETY: writes the id into our struct.
    let r = unsafe { nc::ncclGetUniqueId(&mut id) };
    if r != nc::ncclResult_t::ncclSuccess {
        return Err(format!("ncclGetUniqueId: {}", describe(r)));
    }
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

/// One end of a two-rank communicator on one device.
pub struct NcclPipe {
    ctx: Arc<CudaContext>,
    comm: nc::ncclComm_t,
    stream: Arc<CudaStream>,
    /// Staging buffer for each message (the pipe's capacity).
    buf: CudaSlice<u8>,
    peer: i32,
    ordinal: usize,
}

// SAFETY: the communicator handle is only used by the thread holding the pipe (`&mut self`);
// NCCL communicators may be used from any thread, one at a time.
unsafe impl Send for NcclPipe {}

impl Drop for NcclPipe {
    fn drop(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: the communicator is ours; abort is valid in any state (also mid-operation)
            // and frees it.
            let _ = self.ctx.bind_to_thread();
            unsafe {
                nc::ncclCommAbort(self.comm);
            }
            self.comm = std::ptr::null_mut();
        }
    }
}

/// Poll a non-blocking communicator until its pending operation is no longer in progress.
fn wait_comm(comm: nc::ncclComm_t, deadline: Instant, what: &str) -> R<()> {
    loop {
        let mut state = nc::ncclResult_t::ncclSuccess;
        // SAFETY: `comm` is a live communicator; the call writes one result.
        let r = unsafe { nc::ncclCommGetAsyncError(comm, &mut state) };
        if r != nc::ncclResult_t::ncclSuccess {
            return Err(format!("{what}: ncclCommGetAsyncError: {}", describe(r)));
        }
        match state {
            nc::ncclResult_t::ncclSuccess => return Ok(()),
            nc::ncclResult_t::ncclInProgress => {}
            e => return Err(format!("{what}: {}", describe(e))),
        }
        if Instant::now() >= deadline {
            return Err(format!("{what}: timed out"));
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

impl NcclPipe {
    /// Join communicator `id` as `rank` (of two) on device `ordinal`, with a staging buffer of
    /// `capacity` bytes. Fails at `timeout` if the other rank has not joined.
    pub fn connect(ordinal: usize, id: &[u8], rank: u32, timeout: Duration, capacity: usize) -> R<NcclPipe> {
        let deadline = Instant::now() + timeout;
        if !nccl_present() {
            return Err("libnccl.so could not be loaded".into());
        }
        if id.len() != 128 || rank > 1 {
            return Err(format!("bad rendezvous: a {}-byte id (want 128), rank {rank}", id.len()));
        }
        let ctx = driver::open(ordinal).map_err(|e| e.to_string())?;
        // SAFETY: every operation of the pipe completes (polled) before the call returns, and
        // device buffers are ordered by their own events (`DeviceBytes`), so cudarc's event
        // tracking is not needed.
        unsafe { ctx.disable_event_tracking() };
        ctx.bind_to_thread().map_err(|e| format!("cuda:{ordinal}: {}", driver::describe(&e)))?;
        let stream = ctx.new_stream().map_err(|e| format!("cuda:{ordinal}: a stream: {}", driver::describe(&e)))?;
        let buf = stream.alloc_zeros::<u8>(capacity.max(64)).map_err(|e| format!("cuda:{ordinal}: {capacity} bytes of staging: {}", driver::describe(&e)))?;
        let mut uid = nc::ncclUniqueId { internal: [0; 128] };
        for (d, s) in uid.internal.iter_mut().zip(id) {
            *d = *s as _;
        }
        let mut version: std::ffi::c_int = 0;
        // SAFETY: writes one int.
        unsafe { nc::ncclGetVersion(&mut version) };
        // NCCL_CONFIG_INITIALIZER, non-blocking: every tunable left undefined.
        const UNDEF: std::ffi::c_int = i32::MIN;
        // SAFETY: a plain C struct; every pointer null, every tunable set below.
        let mut config: nc::ncclConfig_t = unsafe { std::mem::zeroed() };
        config.size = std::mem::size_of::<nc::ncclConfig_t>();
        config.magic = 0xcafe_beef;
        config.version = version as _;
        config.blocking = 0;
        config.cgaClusterSize = UNDEF;
        config.minCTAs = UNDEF;
        config.maxCTAs = UNDEF;
        config.splitShare = UNDEF;
        config.trafficClass = UNDEF;
        config.collnetEnable = UNDEF;
        config.CTAPolicy = UNDEF;
        config.shrinkShare = UNDEF;
        config.nvlsCTAs = UNDEF;
        config.nChannelsPerNetPeer = UNDEF;
        config.nvlinkCentricSched = UNDEF;
        let mut comm: nc::ncclComm_t = std::ptr::null_mut();
        // SAFETY: all arguments are valid; in non-blocking mode this returns at once (success or
        // in progress) and `comm` is usable for polling and abort.
        let r = unsafe { nc::ncclCommInitRankConfig(&mut comm, 2, uid, rank as _, &mut config) };
        let pipe = NcclPipe { ctx, comm, stream, buf, peer: 1 - rank as i32, ordinal };
        match r {
            nc::ncclResult_t::ncclSuccess | nc::ncclResult_t::ncclInProgress => {}
            e => return Err(format!("ncclCommInitRankConfig: {}", describe(e))),
        }
        if pipe.comm.is_null() {
            return Err("ncclCommInitRankConfig returned no communicator".into());
        }
        // On failure `pipe` drops here, aborting the half-made communicator.
        wait_comm(pipe.comm, deadline, "joining the NCCL communicator").map_err(|e| format!("{e} after {} ms", timeout.as_millis()))?;
        pipe.ctx.bind_to_thread().map_err(|e| driver::describe(&e))?;
        Ok(pipe)
    }

    /// Wait for this pipe's stream to finish, polling against `deadline`.
    fn wait_stream(&self, deadline: Instant, what: &str) -> R<()> {
        loop {
            // SAFETY: the stream is ours and alive.
            let r = unsafe { cu::cuStreamQuery(self.stream.cu_stream()) };
            match r {
                cu::CUresult::CUDA_SUCCESS => return Ok(()),
                cu::CUresult::CUDA_ERROR_NOT_READY => {}
                e => return Err(format!("{what}: {e:?}")),
            }
            wait_comm(self.comm, Instant::now() + Duration::from_secs(1), what)?;
            if Instant::now() >= deadline {
                return Err(format!("{what}: timed out"));
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    /// Send `data` (at most the pipe's capacity) to the other rank.
    pub fn send(&mut self, data: &[u8], deadline: Instant) -> R<()> {
        if data.len() > self.buf.len() {
            return Err(format!("a {}-byte message exceeds the pipe's {} bytes", data.len(), self.buf.len()));
        }
        self.ctx.bind_to_thread().map_err(|e| driver::describe(&e))?;
        let mut dst = self.buf.slice_mut(0..data.len());
        self.stream.memcpy_htod(data, &mut dst).map_err(|e| format!("staging a message: {}", driver::describe(&e)))?;
        let (ptr, _sync) = self.buf.device_ptr(&self.stream);
        let (len, peer) = (data.len(), self.peer);
        // SAFETY: `ptr` holds `len` bytes on this communicator's device, ordered on its stream
        // after the staging copy; the call waits for the send.
        self.device_op("ncclSend", deadline, |comm, stream| unsafe { nc::ncclSend(ptr as *const _, len, nc::ncclDataType_t::ncclUint8, peer, comm, stream) })
    }

    /// Enqueue one point-to-point operation on this pipe's stream and wait for it.
    fn device_op(&self, what: &str, deadline: Instant, op: impl FnOnce(nc::ncclComm_t, nc::cudaStream_t) -> nc::ncclResult_t) -> R<()> {
        self.ctx.bind_to_thread().map_err(|e| driver::describe(&e))?;
        match op(self.comm, self.stream.cu_stream() as _) {
            nc::ncclResult_t::ncclSuccess | nc::ncclResult_t::ncclInProgress => {}
            e => return Err(format!("{what}: {}", describe(e))),
        }
        wait_comm(self.comm, deadline, what)?;
        self.wait_stream(deadline, what)
    }

    /// Send bytes `range` of `src` straight from device memory (no staging, no host copy).
    /// `src` must live on this pipe's device.
    pub fn send_device(&mut self, src: &DeviceBytes, range: std::ops::Range<usize>, deadline: Instant) -> R<()> {
        self.check_device(src, &range)?;
        let ptr = src.device_ptr(range.start).map_err(|e| e.to_string())?;
        let peer = self.peer;
        // SAFETY: `ptr` addresses `range.len()` bytes of `src` on this device; `src` is ready
        // (device_ptr waited for its event) and outlives the call, which waits for the send.
        self.device_op("ncclSend (device buffer)", deadline, |comm, stream| unsafe {
            nc::ncclSend(ptr as *const _, range.len(), nc::ncclDataType_t::ncclUint8, peer, comm, stream)
        })
    }

    /// Receive `range.len()` bytes straight into bytes `range` of `dst` in device memory.
    pub fn recv_device(&mut self, dst: &mut DeviceBytes, range: std::ops::Range<usize>, deadline: Instant) -> R<()> {
        self.check_device(dst, &range)?;
        let ptr = dst.device_ptr(range.start).map_err(|e| e.to_string())?;
        let peer = self.peer;
        // SAFETY: as in send_device; `dst` is borrowed mutably, so nothing else touches it.
        self.device_op("ncclRecv (device buffer)", deadline, |comm, stream| unsafe {
            nc::ncclRecv(ptr as *mut _, range.len(), nc::ncclDataType_t::ncclUint8, peer, comm, stream)
        })
    }

    /// A zeroed device buffer of `len` bytes on this pipe's device, to receive into.
    pub fn alloc(&self, len: usize) -> R<DeviceBytes> {
        DeviceBytes::alloc(self.ordinal, len).map_err(|e| e.to_string())
    }

    fn check_device(&self, b: &DeviceBytes, range: &std::ops::Range<usize>) -> R<()> {
        if b.ordinal() != self.ordinal {
            return Err(format!("a buffer on cuda:{} given to a pipe on cuda:{}", b.ordinal(), self.ordinal));
        }
        if range.start > range.end || range.end > b.len() {
            return Err(format!("bytes {}..{} of a {}-byte device buffer", range.start, range.end, b.len()));
        }
        Ok(())
    }

    /// Receive exactly `out.len()` bytes from the other rank.
    pub fn recv(&mut self, out: &mut [u8], deadline: Instant) -> R<()> {
        if out.len() > self.buf.len() {
            return Err(format!("a {}-byte message exceeds the pipe's {} bytes", out.len(), self.buf.len()));
        }
        self.ctx.bind_to_thread().map_err(|e| driver::describe(&e))?;
        let (ptr, _sync) = self.buf.device_ptr(&self.stream);
        let (len, peer) = (out.len(), self.peer);
        // SAFETY: the staging buffer holds at least `len` bytes; the call waits for the receive.
        self.device_op("ncclRecv", deadline, |comm, stream| unsafe { nc::ncclRecv(ptr as *mut _, len, nc::ncclDataType_t::ncclUint8, peer, comm, stream) })?;
        let src = self.buf.slice(0..out.len());
        self.stream.memcpy_dtoh(&src, out).map_err(|e| format!("copying a message out: {}", driver::describe(&e)))
    }
}
