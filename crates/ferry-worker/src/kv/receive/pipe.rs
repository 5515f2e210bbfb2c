//! The decode side of a device pipe ([`crate::kv::device`]): `KvTransfer.NcclConnect` joins the
//! communicator ([`accept`]), then the pipe's own thread serves transfers on it through the one
//! receive loop ([`super::drive`]).

use super::assembler::Target;
use super::drive::{drive, InboundLink, Session};
use super::frame_event::FrameEvent;
use super::inbound::{Event, Link};
use super::transfers::KvReceiver;
use crate::error::{Result, WorkerError};
use crate::kv::chunks::{Chunk, MAX_CHUNK_BYTES};
use crate::kv::device::{recv_frame, send_message, BytePipe, PipeConnector, IDLE_CLOSE};
use crate::kv::frame::Kind;
use ferry_engine::KvBuffer;
use ferry_proto::v1::{KvAckFrame, KvTransport as Transport, NcclConnectRequest};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `KvTransfer.NcclConnect`: join the communicator, then serve transfers on it from a thread of
/// its own until the peer closes it, it idles for [`IDLE_CLOSE`], or an operation fails.
pub async fn accept(receiver: Arc<KvReceiver>, connector: Option<Arc<dyn PipeConnector>>, req: NcclConnectRequest, op_timeout: Duration, slots: &PipeSlots) -> Result<u32> {
    // Peers that predate the field ask for NCCL.
    let wanted = match Transport::try_from(req.transport).unwrap_or(Transport::Unspecified) {
        Transport::Unspecified => Transport::Nccl,
        k => k,
    };
    let connector = match connector {
        Some(c) if c.transport() == wanted => c,
        Some(c) => return Err(WorkerError::PeerUnavailable { peer: req.peer, what: format!("this decode worker's device pipes are {}, not {wanted}", c.transport()) }),
        None => return Err(WorkerError::PeerUnavailable { peer: req.peer, what: format!("this decode worker has no {wanted} pipes (it runs on the CPU, or the library could not be loaded)") }),
    };
    if wanted == Transport::Nccl && !req.device_uuid.is_empty() && connector.device_uuid().is_some_and(|u| req.device_uuid[..] == u[..]) {
        return Err(WorkerError::PeerUnavailable {
            peer: req.peer,
            what: "both workers are on the same GPU, where NCCL cannot pair two ranks (use --kv-transport cuda-ipc)".into(),
        });
    }
    if req.fingerprint != receiver.fingerprint() {
        return Err(WorkerError::Incompatible { id: 0, what: format!("{wanted} peer {} serves model {}, this worker {}", req.peer, req.fingerprint, receiver.fingerprint()) });
    }
    // Held from here until the pipe closes: the rendezvous RPC is not authenticated by a
    // transfer token, so what callers can make this worker hold is bounded.
    let slot = slots.take().ok_or_else(|| WorkerError::Exhausted(format!("{} device pipes are open or being set up on this worker", PipeSlots::MAX)))?;
    let timeout = Duration::from_millis(req.timeout_ms.clamp(100, 30_000) as u64);
    let id = req.unique_id.to_vec();
    let c = connector.clone();
    let pipe = tokio::task::spawn_blocking(move || c.connect(&id, 1, timeout))
        .await
        .map_err(|e| WorkerError::Internal(e.to_string()))?
        .map_err(|e| WorkerError::PeerUnavailable { peer: req.peer.clone(), what: format!("{wanted} pipe: {e}") })?;
    let rt = tokio::runtime::Handle::current();
    let peer = req.peer.clone();
    std::thread::Builder::new()
        .name("ferry-kv-pipe".into())
        .spawn(move || {
            let _slot = slot;
            metrics::gauge!(crate::cluster::metrics::names::KV_NCCL_PIPES).increment(1.0);
            match serve(&receiver, pipe, &rt, op_timeout) {
                Ok(()) => tracing::debug!(peer = %peer, transport = %wanted, "device pipe closed"),
                Err(e) => tracing::warn!(peer = %peer, transport = %wanted, "device pipe dropped: {e}"),
            }
            metrics::gauge!(crate::cluster::metrics::names::KV_NCCL_PIPES).decrement(1.0);
        })
        .map_err(|e| WorkerError::Internal(format!("starting a KV pipe thread: {e}")))?;
    Ok(connector.device())
}

/// The pipes (open or being set up) a decode worker allows at once.
#[derive(Default)]
pub struct PipeSlots(Arc<std::sync::atomic::AtomicUsize>);

/// One taken slot, given back when dropped.
pub struct PipeSlot(Arc<std::sync::atomic::AtomicUsize>);

impl PipeSlots {
    pub const MAX: usize = 64;

    fn take(&self) -> Option<PipeSlot> {
        use std::sync::atomic::Ordering::AcqRel;
        self.0.fetch_update(AcqRel, std::sync::atomic::Ordering::Acquire, |n| (n < Self::MAX).then_some(n + 1)).ok()?;
        Some(PipeSlot(self.0.clone()))
    }

    /// Slots now taken.
    pub fn taken(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }
}

impl Drop for PipeSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// A pipe as a link: transfers one after another; every receive is bounded by a deadline (the
/// idle close between transfers, the operation timeout inside one).
struct PipeInbound {
    pipe: Box<dyn BytePipe>,
    op_timeout: Duration,
    /// Scratch for control bodies and dropped chunks.
    body: Vec<u8>,
}

impl PipeInbound {
    fn deadline(&self) -> Instant {
        Instant::now() + self.op_timeout
    }
}

/// A pipe operation that failed: the pipe is out of step.
fn pipe_broken(e: String) -> Event {
    Event::Broken(format!("device pipe: {e}"))
}

impl InboundLink for PipeInbound {
    async fn next(&mut self, idle: bool) -> Event {
        let deadline = Instant::now() + if idle { IDLE_CLOSE } else { self.op_timeout };
        let _t = (!idle).then(|| ferry_core::phase_clock::span("receive: wait for the next frame header"));
        match recv_frame(self.pipe.as_mut(), &mut self.body, deadline) {
            Ok(h) => h.event(&self.body),
            Err(e) => pipe_broken(e),
        }
    }

    async fn take(&mut self, c: Chunk, target: Target<'_>) -> Event {
        let deadline = self.deadline();
        let r = match target {
            Target::Host(v) => {
                let start = v.len();
                v.resize(start + c.len, 0);
                let r = self.pipe.recv(&mut v[start..], deadline);
                if r.is_err() {
                    v.truncate(start);
                }
                r
            }
            Target::Buffer(buf, range) => self.pipe.recv_buffer(buf, range, deadline),
        };
        match r {
            Ok(()) => {
                if c.buffer {
                    metrics::counter!(crate::cluster::metrics::names::KV_BUFFER_BYTES, "side" => "receive").increment(c.len as u64);
                }
                Event::Landed
            }
            Err(e) => pipe_broken(e),
        }
    }

    async fn skip(&mut self, c: Chunk) -> Event {
        let deadline = self.deadline();
        let r = if c.buffer {
            // Where buffer frames are received (device memory under NCCL), as the sender sent it.
            self.pipe.alloc_buffer(c.len).and_then(|mut scratch| self.pipe.recv_buffer(&mut scratch, 0..c.len, deadline))
        } else {
            self.body.resize(c.len, 0);
            self.pipe.recv(&mut self.body, deadline)
        };
        r.map_or_else(pipe_broken, |()| Event::Landed)
    }

    fn alloc(&mut self, len: usize) -> std::result::Result<KvBuffer, String> {
        let _t = ferry_core::phase_clock::span("receive: allocate the body buffer");
        self.pipe.alloc_buffer(len)
    }

    async fn reply(&mut self, reply: KvAckFrame) -> Result<()> {
        let deadline = self.deadline();
        let sent = send_message(self.pipe.as_mut(), Kind::Reply, &reply, deadline)
            .map_err(|e| WorkerError::PeerUnavailable { peer: "prefill worker".into(), what: format!("device pipe: sending the reply: {e}") });
        ferry_core::phase_clock::print_report("kv pipe receiver, one transfer");
        sent
    }
}

/// Serve transfers on `pipe` (blocking: this is the pipe's own thread) until the sender retires
/// it, it idles for [`IDLE_CLOSE`], or an operation fails.
pub fn serve(receiver: &Arc<KvReceiver>, pipe: Box<dyn BytePipe>, rt: &tokio::runtime::Handle, op_timeout: Duration) -> Result<()> {
    let mut link = PipeInbound { pipe, op_timeout, body: Vec::with_capacity(MAX_CHUNK_BYTES) };
    rt.block_on(drive(&mut Session::new(receiver, Link::Pipe), &mut link))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::in_process::InProcessConnector;

    #[test]
    fn pipe_slots_are_bounded_and_come_back() {
        let slots = PipeSlots::default();
        let held: Vec<PipeSlot> = (0..PipeSlots::MAX).map(|_| slots.take().expect("a slot")).collect();
        assert!(slots.take().is_none(), "no slot past the limit");
        drop(held);
        assert_eq!(slots.taken(), 0);
        assert!(slots.take().is_some());
    }

    #[test]
    fn in_process_pipes_need_both_ranks_and_matching_sizes() {
        let c = InProcessConnector::new();
        let id = c.new_id().unwrap();
        let c2 = c.clone();
        let id2 = id.clone();
        let t = std::thread::spawn(move || c2.connect(&id2, 1, Duration::from_secs(5)));
        let mut a = c.connect(&id, 0, Duration::from_secs(5)).unwrap();
        let mut b = t.join().unwrap().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        a.send(b"hello", deadline).unwrap();
        let mut buf = [0u8; 5];
        b.recv(&mut buf, deadline).unwrap();
        assert_eq!(&buf, b"hello");
        a.send(b"hi", deadline).unwrap();
        let mut wrong = [0u8; 3];
        assert!(b.recv(&mut wrong, deadline).unwrap_err().contains("sizes must match"));
        // Only one rank joins: it gives up at its timeout.
        let id = c.new_id().unwrap();
        let t0 = Instant::now();
        assert!(c.connect(&id, 0, Duration::from_millis(100)).is_err());
        assert!(t0.elapsed() >= Duration::from_millis(100));
    }

    /// First GPU run: a NCCL pair on one GPU waited out the 10 s connect timeout before falling
    /// back. With both UUIDs known, the decode side refuses at once.
    #[tokio::test]
    async fn a_nccl_pair_on_one_gpu_is_refused_at_once() {
        let layout = ferry_core::KvLayout { dtype: ferry_core::KvDtype::F32, block_size: 16, n_layers: 1, n_kv_heads: 1, head_dim: 4 };
        let receiver = KvReceiver::sink("fp".into(), layout);
        let c = InProcessConnector::new();
        *c.uuid.lock().unwrap() = Some([7; 16]);
        let req = |uuid: &[u8]| NcclConnectRequest { unique_id: c.new_id().unwrap().into(), peer: "p".into(), timeout_ms: 100, fingerprint: "fp".into(), transport: Transport::Nccl as i32, device_uuid: uuid.to_vec().into() };
        let slots = PipeSlots::default();
        let t = Instant::now();
        let e = accept(receiver.clone(), Some(c.clone()), req(&[7; 16]), Duration::from_secs(1), &slots).await.unwrap_err();
        assert!(e.to_string().contains("same GPU"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(1));
        // Another GPU's UUID goes on to the rendezvous (which times out here: no rank 0 joins).
        let e = accept(receiver, Some(c.clone()), req(&[8; 16]), Duration::from_secs(1), &slots).await.unwrap_err();
        assert!(!e.to_string().contains("same GPU"), "{e}");
    }
}
