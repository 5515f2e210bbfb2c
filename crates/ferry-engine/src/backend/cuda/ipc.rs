//! A KV pipe between two processes of one node through CUDA IPC (the transport `cuda-ipc`; the
//! protocol on top is `ferry-worker`'s `kv::pipe`, the same as over NCCL).
//!
//! NCCL cannot pair two ranks on one GPU, and a prefill and a decode worker sharing a node (or a
//! GPU) need no network library to move device memory: the driver maps one process's allocation
//! into another (`cuIpcGetMemHandle` / `cuIpcOpenMemHandle`). Here the **receiver exports** the
//! buffer it receives a payload body into ([`DeviceBytes::exportable`]), and the sender maps it
//! once per buffer and copies each layer into place on its own stream: one device-to-device copy
//! per byte, no host hop, no staging. (Exporting the sender's layer buffers instead would need
//! them outside cudarc's stream-ordered pool, whose memory cannot be exported this way.)
//!
//! Host messages (frame headers, control bodies, and the small descriptors below) go over a Unix
//! socket between the two processes, in order:
//! - the rendezvous id names the socket (rank 0 listens, rank 1 connects) and the node's boot id,
//!   so a peer on another node fails at once and the transfer falls back to a host transport;
//! - for each buffer frame the receiver sends a [`Dest`] (where in which exported buffer; or
//!   "send it to me on the socket" for a buffer it cannot export), the sender copies and answers
//!   one byte when its copy has completed.
//!
//! Every blocking call is bounded by its deadline (socket timeouts, polled stream completion).
//! Status: run on one H200 (2026-12-04): clusters over it serve the CPU engine's exact text; it
//! moves ~37 GB/s, held back by a fixed ~0.43 ms per frame (docs/benchmarks.md).

use super::bytes::DeviceBytes;
use super::driver;
use cudarc::driver::{sys as cu, CudaContext, CudaStream};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

type R<T> = std::result::Result<T, String>;

/// First bytes of the rank-1 hello, and its version.
const HELLO: &[u8; 8] = b"ferryipc";
const VERSION: u32 = 1;

/// This node's identity for the rendezvous (Linux's boot id; a constant elsewhere).
fn node_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string()).unwrap_or_else(|_| "unknown-node".into())
}

/// The folder for rendezvous sockets: `$FERRY_IPC_DIR`, else `ferry-ipc-UID` in the temporary
/// folder, made private to this user (0700). Workers in different containers of one node need a
/// shared folder here (and a shared IPC namespace for CUDA IPC itself).
fn socket_dir() -> R<PathBuf> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    if let Some(d) = std::env::var_os("FERRY_IPC_DIR") {
        return Ok(PathBuf::from(d));
    }
    let uid = std::fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("ferry-ipc-{uid}"));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot make {}: {e}", dir.display()))?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).map_err(|e| format!("cannot restrict {}: {e}", dir.display()))?;
    Ok(dir)
}

/// Listeners made by [`new_id`] and not yet taken by rank 0's [`IpcPipe::connect`].
fn listeners() -> &'static Mutex<HashMap<Vec<u8>, (UnixListener, PathBuf)>> {
    static L: OnceLock<Mutex<HashMap<Vec<u8>, (UnixListener, PathBuf)>>> = OnceLock::new();
    L.get_or_init(Default::default)
}

/// A fresh rendezvous id: `boot-id\nsocket-path`, with the socket already listening (so rank 1
/// can connect as soon as it is told the id).
pub fn new_id() -> R<Vec<u8>> {
    let name = format!("kv-{}-{:016x}.sock", std::process::id(), rand::random::<u64>());
    let path = socket_dir()?.join(name);
    let listener = UnixListener::bind(&path).map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
    let id = format!("{}\n{}", node_id(), path.display()).into_bytes();
    listeners().lock().unwrap_or_else(|p| p.into_inner()).insert(id.clone(), (listener, path));
    Ok(id)
}

/// Where the receiver wants the next buffer frame's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dest {
    /// Into exported buffer `id` (opened with `handle`), at byte `offset`.
    Device { id: u64, handle: [u8; 64], offset: u64, len: u64 },
    /// Over the socket (the receiver's buffer is not exportable).
    Socket { len: u64 },
}

impl Dest {
    const BYTES: usize = 8 + 8 + 64 + 8 + 8;

    fn len(&self) -> u64 {
        match *self {
            Dest::Device { len, .. } | Dest::Socket { len } => len,
        }
    }

    fn encode(&self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        match *self {
            Dest::Device { id, handle, offset, len } => {
                b[0..8].copy_from_slice(&1u64.to_le_bytes());
                b[8..16].copy_from_slice(&id.to_le_bytes());
                b[16..80].copy_from_slice(&handle);
                b[80..88].copy_from_slice(&offset.to_le_bytes());
                b[88..96].copy_from_slice(&len.to_le_bytes());
            }
            Dest::Socket { len } => {
                b[0..8].copy_from_slice(&2u64.to_le_bytes());
                b[88..96].copy_from_slice(&len.to_le_bytes());
            }
        }
        b
    }

    fn decode(b: &[u8; Self::BYTES]) -> R<Dest> {
        let word = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().unwrap_or([0; 8]));
        let len = word(88..96);
        match word(0..8) {
            1 => Ok(Dest::Device { id: word(8..16), handle: b[16..80].try_into().unwrap_or([0; 64]), offset: word(80..88), len }),
            2 => Ok(Dest::Socket { len }),
            k => Err(format!("bad buffer descriptor (kind {k})")),
        }
    }
}

/// One end of an IPC pipe on device `ordinal`.
pub struct IpcPipe {
    sock: UnixStream,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: usize,
    /// The peer buffers this side has open, most recent last: (id, base address here). The peer
    /// reuses its buffers, so a mapping usually serves many transfers.
    mapped: Vec<(u64, cu::CUdeviceptr)>,
}

/// Peer buffers kept mapped per pipe.
const MAPPED_MAX: usize = 8;

/// How long [`IpcPipe::wait_stream`] polls without sleeping (a copy of one layer takes
/// microseconds to a millisecond).
const SPIN: Duration = Duration::from_millis(2);

// SAFETY: the raw mapped pointer is only used by the thread holding the pipe (`&mut self`).
unsafe impl Send for IpcPipe {}

impl Drop for IpcPipe {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        for (_, ptr) in std::mem::take(&mut self.mapped) {
            unmap(ptr);
        }
    }
}

/// Close a mapping made by cuIpcOpenMemHandle (the pipe's context current).
fn unmap(ptr: cu::CUdeviceptr) {
    // SAFETY: `ptr` was returned by cuIpcOpenMemHandle on this context and not closed since.
    unsafe {
        cu::cuIpcCloseMemHandle(ptr);
    }
}

fn cu_ok(r: cu::CUresult, what: &str) -> R<()> {
    if r == cu::CUresult::CUDA_SUCCESS { Ok(()) } else { Err(format!("{what}: {r:?}")) }
}

/// How long is left until `deadline` (at least a millisecond: a zero socket timeout is refused).
fn left(deadline: Instant, what: &str) -> R<Duration> {
    let d = deadline.saturating_duration_since(Instant::now());
    if d.is_zero() {
        return Err(format!("{what}: timed out"));
    }
    Ok(d.max(Duration::from_millis(1)))
}

impl IpcPipe {
    /// Join the rendezvous `id` as `rank` (0: the prefill worker, which made the id; 1: the
    /// decode worker) on device `ordinal`. Fails at `timeout`, or at once when the id names
    /// another node.
    pub fn connect(ordinal: usize, id: &[u8], rank: u32, timeout: Duration) -> R<IpcPipe> {
        let deadline = Instant::now() + timeout;
        let text = std::str::from_utf8(id).map_err(|_| "bad rendezvous id (not UTF-8)".to_string())?;
        let (node, path) = text.split_once('\n').ok_or("bad rendezvous id (no socket path)")?;
        if node != node_id() {
            return Err(format!("the peer runs on another node (boot id {node}): CUDA IPC needs both workers on one node"));
        }
        let sock = match rank {
            0 => {
                let (listener, path) = listeners().lock().unwrap_or_else(|p| p.into_inner()).remove(id).ok_or("rank 0 joined an id it did not make")?;
                let accepted = accept(&listener, deadline);
                // The socket file is not needed once the peer is in (or never came).
                let _ = std::fs::remove_file(&path);
                let mut s = accepted?;
                s.set_read_timeout(Some(left(deadline, "waiting for the peer's hello")?)).map_err(|e| e.to_string())?;
                let mut hello = [0u8; 16];
                s.read_exact(&mut hello).map_err(|e| format!("the peer's hello: {e}"))?;
                if &hello[..8] != HELLO || u32::from_le_bytes(hello[8..12].try_into().unwrap_or([0; 4])) != VERSION {
                    return Err("the peer is not a ferry CUDA IPC pipe of this version".into());
                }
                s
            }
            1 => {
                let mut s = connect_path(Path::new(path), deadline)?;
                let mut hello = [0u8; 16];
                hello[..8].copy_from_slice(HELLO);
                hello[8..12].copy_from_slice(&VERSION.to_le_bytes());
                hello[12..16].copy_from_slice(&(ordinal as u32).to_le_bytes());
                s.write_all(&hello).map_err(|e| format!("hello: {e}"))?;
                s
            }
            r => return Err(format!("bad rank {r}")),
        };
        let ctx = driver::open(ordinal).map_err(|e| e.to_string())?;
        // SAFETY: every copy of the pipe completes (polled) before its call returns, and device
        // buffers are ordered by their own events (`DeviceBytes`): no event tracking needed.
        unsafe { ctx.disable_event_tracking() };
        ctx.bind_to_thread().map_err(|e| format!("cuda:{ordinal}: {}", driver::describe(&e)))?;
        let stream = ctx.new_stream().map_err(|e| format!("cuda:{ordinal}: a stream: {}", driver::describe(&e)))?;
        Ok(IpcPipe { sock, ctx, stream, ordinal, mapped: Vec::new() })
    }

    fn write(&mut self, data: &[u8], deadline: Instant, what: &str) -> R<()> {
        self.sock.set_write_timeout(Some(left(deadline, what)?)).map_err(|e| format!("{what}: {e}"))?;
        self.sock.write_all(data).map_err(|e| format!("{what}: {e}"))
    }

    fn read(&mut self, out: &mut [u8], deadline: Instant, what: &str) -> R<()> {
        self.sock.set_read_timeout(Some(left(deadline, what)?)).map_err(|e| format!("{what}: {e}"))?;
        self.sock.read_exact(out).map_err(|e| format!("{what}: {e}"))
    }

    /// Send one host message.
    pub fn send(&mut self, data: &[u8], deadline: Instant) -> R<()> {
        self.write(data, deadline, "sending a message")
    }

    /// Receive one host message of exactly `out.len()` bytes.
    pub fn recv(&mut self, out: &mut [u8], deadline: Instant) -> R<()> {
        self.read(out, deadline, "receiving a message")
    }

    /// Wait for this pipe's stream, polling against `deadline`: spinning (yielding the core)
    /// for the first [`SPIN`], then sleeping between polls (a sleep of a few microseconds lasts
    /// tens of them, the timer's slack, which a frame would pay every time).
    fn wait_stream(&self, deadline: Instant, what: &str) -> R<()> {
        let spin_until = Instant::now() + SPIN;
        loop {
            // SAFETY: the stream is ours and alive.
            match unsafe { cu::cuStreamQuery(self.stream.cu_stream()) } {
                cu::CUresult::CUDA_SUCCESS => return Ok(()),
                cu::CUresult::CUDA_ERROR_NOT_READY => {}
                e => return Err(format!("{what}: {e:?}")),
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(format!("{what}: timed out"));
            }
            if now < spin_until {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(10));
            }
        }
    }

    /// The peer's exported buffer `id` mapped into this process (the least recently used of
    /// [`MAPPED_MAX`] mappings is closed to make room).
    fn map(&mut self, id: u64, handle: [u8; 64]) -> R<cu::CUdeviceptr> {
        self.ctx.bind_to_thread().map_err(|e| driver::describe(&e))?;
        if let Some(i) = self.mapped.iter().position(|&(m, _)| m == id) {
            let m = self.mapped.remove(i);
            self.mapped.push(m);
            return Ok(m.1);
        }
        if self.mapped.len() >= MAPPED_MAX {
            unmap(self.mapped.remove(0).1);
        }
        let h = cu::CUipcMemHandle { reserved: std::array::from_fn(|i| handle[i] as _) };
        let mut ptr: cu::CUdeviceptr = 0;
        // SAFETY: writes one pointer; the handle came from the peer's cuIpcGetMemHandle. Lazy
        // peer access lets the peer's buffer sit on another GPU of this node.
        cu_ok(unsafe { cu::cuIpcOpenMemHandle_v2(&mut ptr, h, cu::CUipcMem_flags_enum::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32) }, "cuIpcOpenMemHandle")?;
        self.mapped.push((id, ptr));
        Ok(ptr)
    }

    /// The receiver's descriptor for a buffer frame of `len` bytes.
    fn read_dest(&mut self, len: usize, deadline: Instant) -> R<Dest> {
        let _t = ferry_core::phase_clock::span("ipc send: wait for the receiver's descriptor");
        let mut b = [0u8; Dest::BYTES];
        self.read(&mut b, deadline, "waiting for the receiver's buffer descriptor")?;
        let d = Dest::decode(&b)?;
        if d.len() != len as u64 {
            return Err(format!("the receiver wants {} bytes, the frame has {len}", d.len()));
        }
        Ok(d)
    }

    /// Into the peer's exported buffer `id` at `offset`: `copy(destination, stream)` enqueues the
    /// copy on this pipe's stream; it is waited for, then confirmed to the peer.
    fn copy_into_peer(&mut self, id: u64, handle: [u8; 64], offset: u64, deadline: Instant, what: &str, copy: impl FnOnce(cu::CUdeviceptr, cu::CUstream) -> cu::CUresult) -> R<()> {
        let dst = {
            let _t = ferry_core::phase_clock::span("ipc send: map the peer's buffer");
            self.map(id, handle)?
        };
        {
            let _t = ferry_core::phase_clock::span("ipc send: copy and wait for it");
            cu_ok(copy(dst + offset, self.stream.cu_stream()), what)?;
            self.wait_stream(deadline, "copying into the peer's buffer")?;
        }
        let _t = ferry_core::phase_clock::span("ipc send: confirm");
        self.write(&[1], deadline, "confirming the copy")
    }

    /// Send bytes `range` of `src` (on this pipe's device) into the receiver's buffer.
    pub fn send_device(&mut self, src: &DeviceBytes, range: std::ops::Range<usize>, deadline: Instant) -> R<()> {
        if src.ordinal() != self.ordinal {
            return Err(format!("a buffer on cuda:{} given to a pipe on cuda:{}", src.ordinal(), self.ordinal));
        }
        if range.start > range.end || range.end > src.len() {
            return Err(format!("bytes {}..{} of a {}-byte device buffer", range.start, range.end, src.len()));
        }
        let len = range.len();
        match self.read_dest(len, deadline)? {
            Dest::Device { id, handle, offset, .. } => {
                let from = src.device_ptr(range.start).map_err(|e| e.to_string())?;
                // SAFETY: `from` addresses `len` bytes of `src` (ready: device_ptr waited for its
                // fill); the destination lies in the peer's exported buffer, whose bounds the peer
                // checked against its buffer when it sent the descriptor. The copy is waited for
                // before `src` can be released.
                self.copy_into_peer(id, handle, offset, deadline, "cuMemcpyDtoDAsync (peer buffer)", |dst, stream| unsafe { cu::cuMemcpyDtoDAsync_v2(dst, from, len, stream) })
            }
            Dest::Socket { .. } => {
                let host = src.to_host(range).map_err(|e| e.to_string())?;
                self.write(&host, deadline, "sending buffer bytes on the socket")
            }
        }
    }

    /// Send host bytes as a buffer frame (a GPU worker does not make these; kept for the
    /// protocol's sake): into the peer's buffer from the host, or on the socket.
    pub fn send_host_as_buffer(&mut self, data: &[u8], deadline: Instant) -> R<()> {
        match self.read_dest(data.len(), deadline)? {
            Dest::Device { id, handle, offset, .. } => {
                // SAFETY: `data` is `data.len()` host bytes alive across the wait; the bounds as
                // in send_device.
                self.copy_into_peer(id, handle, offset, deadline, "cuMemcpyHtoDAsync (peer buffer)", |dst, stream| unsafe { cu::cuMemcpyHtoDAsync_v2(dst, data.as_ptr() as *const _, data.len(), stream) })
            }
            Dest::Socket { .. } => self.write(data, deadline, "sending buffer bytes on the socket"),
        }
    }

    /// Receive a buffer frame into bytes `range` of `dst`: written in place by the sender when
    /// `dst` is exportable, else over the socket.
    pub fn recv_device(&mut self, dst: &mut DeviceBytes, range: std::ops::Range<usize>, deadline: Instant) -> R<()> {
        if range.start > range.end || range.end > dst.len() {
            return Err(format!("bytes {}..{} of a {}-byte device buffer", range.start, range.end, dst.len()));
        }
        match dst.ipc_export() {
            Some(e) => {
                let d = Dest::Device { id: e.id, handle: e.handle, offset: range.start as u64, len: range.len() as u64 };
                {
                    let _t = ferry_core::phase_clock::span("ipc receive: send the descriptor");
                    self.write(&d.encode(), deadline, "sending the buffer descriptor")?;
                }
                let _t = ferry_core::phase_clock::span("ipc receive: wait for the sender's copy");
                let mut done = [0u8; 1];
                self.read(&mut done, deadline, "waiting for the sender's copy")?;
                if done[0] != 1 {
                    return Err(format!("the sender's copy failed (answer {})", done[0]));
                }
                Ok(())
            }
            None => {
                let mut host = vec![0u8; range.len()];
                self.recv_host_buffer(&mut host, deadline)?;
                dst.write(range.start, &host).map_err(|e| e.to_string())
            }
        }
    }

    /// Receive a buffer frame's bytes into host memory (over the socket).
    pub fn recv_host_buffer(&mut self, out: &mut [u8], deadline: Instant) -> R<()> {
        self.write(&Dest::Socket { len: out.len() as u64 }.encode(), deadline, "sending the buffer descriptor")?;
        self.read(out, deadline, "receiving buffer bytes on the socket")
    }

    /// A buffer of `len` bytes on this pipe's device that the peer writes into (reused across transfers).
    pub fn alloc(&self, len: usize) -> R<DeviceBytes> {
        DeviceBytes::exportable(self.ordinal, len).map_err(|e| e.to_string())
    }
}

/// Accept one connection before `deadline`.
fn accept(listener: &UnixListener, deadline: Instant) -> R<UnixStream> {
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(|e| e.to_string())?;
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(format!("accepting the peer: {e}")),
        }
        if Instant::now() >= deadline {
            return Err("the peer did not connect in time".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Connect to the socket at `path`, retrying until `deadline` (rank 0 may not be listening yet).
fn connect_path(path: &Path, deadline: Instant) -> R<UnixStream> {
    loop {
        match UnixStream::connect(path) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(format!("connecting to {}: {e}", path.display())),
            Err(_) => std::thread::sleep(Duration::from_millis(2)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_round_trip_and_bad_ones_are_refused() {
        for d in [Dest::Device { id: 7, handle: std::array::from_fn(|i| i as u8), offset: 4096, len: 1 << 20 }, Dest::Socket { len: 12 }] {
            assert_eq!(Dest::decode(&d.encode()).unwrap(), d);
        }
        let mut b = Dest::Socket { len: 1 }.encode();
        b[0] = 9;
        assert!(Dest::decode(&b).unwrap_err().contains("kind 9"));
    }

    #[test]
    fn a_peer_on_another_node_or_a_bad_id_fails_at_once() {
        let t = Instant::now();
        let e = IpcPipe::connect(0, b"another-boot-id\n/tmp/x.sock", 1, Duration::from_secs(5)).err().unwrap();
        assert!(e.contains("another node"), "{e}");
        assert!(IpcPipe::connect(0, b"no newline", 1, Duration::from_secs(5)).err().unwrap().contains("no socket path"));
        assert!(IpcPipe::connect(0, &[0xff, 0xfe], 1, Duration::from_secs(5)).err().unwrap().contains("UTF-8"));
        assert!(t.elapsed() < Duration::from_secs(1));
    }

    #[test]
    fn rank_zero_only_joins_its_own_ids() {
        let id = format!("{}\n/nonexistent/kv.sock", node_id()).into_bytes();
        assert!(IpcPipe::connect(0, &id, 0, Duration::from_millis(50)).err().unwrap().contains("did not make"));
    }
}
