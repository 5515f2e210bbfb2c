//! Device pipes between workers of one process over in-memory queues: a fake of the NCCL pipe
//! for tests (never a production transport). Built for this crate's tests and with the
//! `testing` feature; at `kv::in_process::InProcessConnector`.

use crate::kv::device::{BytePipe, PipeConnector};
use ferry_engine::KvBuffer;
use ferry_proto::v1::KvTransport as Transport;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};


type Queue = std::sync::mpsc::Receiver<Vec<u8>>;

struct Half {
    tx: std::sync::mpsc::Sender<Vec<u8>>,
    rx: Queue,
}

/// Pipes between workers of one process over in-memory queues, with NCCL's contract (ordered
/// messages, matching sizes, both ranks must join): the pipe protocol, rendezvous and fallbacks
/// run without a GPU. Not a transport for production.
#[derive(Default)]
pub struct InProcessConnector {
    /// Ids created and not yet joined by both ranks: (rank 0's half, rank 1's half).
    waiting: Mutex<HashMap<Vec<u8>, [Option<Half>; 2]>>,
    joined: std::sync::Condvar,
    /// Test hook: rank 1 never joins (an unreachable peer; the rendezvous must time out).
    pub refuse_join: std::sync::atomic::AtomicBool,
    /// Test hook: the next rank-0 (prefill side) pipe fails every send after this many.
    pub fail_after_sends: Mutex<Option<usize>>,
    /// Rendezvous timeout in milliseconds (0: the default).
    connect_timeout_ms: std::sync::atomic::AtomicU64,
    /// Buffer messages sent (the layers that went "device to device").
    buffer_sends: Arc<std::sync::atomic::AtomicUsize>,
    /// Test hook: flip one byte of every buffer message sent (a corrupting link).
    pub corrupt_buffers: Arc<std::sync::atomic::AtomicBool>,
    /// Test hook: the device UUID these pipes report (none by default).
    pub uuid: Mutex<Option<[u8; 16]>>,
}

impl InProcessConnector {
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    pub fn set_connect_timeout(&self, t: Duration) {
        self.connect_timeout_ms.store(t.as_millis() as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// Buffer messages sent so far over this connector's pipes.
    pub fn buffer_sends(&self) -> usize {
        self.buffer_sends.load(std::sync::atomic::Ordering::Relaxed)
    }
}

struct InProcessPipe {
    half: Half,
    sends_left: Option<usize>,
    buffer_sends: Arc<std::sync::atomic::AtomicUsize>,
    corrupt_buffers: Arc<std::sync::atomic::AtomicBool>,
}

impl BytePipe for InProcessPipe {
    fn send(&mut self, data: &[u8], _deadline: Instant) -> std::result::Result<(), String> {
        if let Some(n) = &mut self.sends_left {
            if *n == 0 {
                return Err("injected failure".into());
            }
            *n -= 1;
        }
        self.half.tx.send(data.to_vec()).map_err(|_| "peer closed the pipe".to_string())
    }

    fn recv(&mut self, buf: &mut [u8], deadline: Instant) -> std::result::Result<(), String> {
        let wait = deadline.saturating_duration_since(Instant::now());
        let msg = self.half.rx.recv_timeout(wait).map_err(|e| match e {
            std::sync::mpsc::RecvTimeoutError::Timeout => "timed out".to_string(),
            std::sync::mpsc::RecvTimeoutError::Disconnected => "peer closed the pipe".to_string(),
        })?;
        if msg.len() != buf.len() {
            // NCCL would corrupt memory or hang here; the protocol must never do this.
            return Err(format!("message of {} bytes received into {} (sizes must match)", msg.len(), buf.len()));
        }
        buf.copy_from_slice(&msg);
        Ok(())
    }

    fn send_buffer(&mut self, buf: &KvBuffer, range: Range<usize>, deadline: Instant) -> std::result::Result<(), String> {
        let mut host = buf.to_host(range).map_err(|e| e.to_string())?;
        if self.corrupt_buffers.load(std::sync::atomic::Ordering::Relaxed)
            && let Some(b) = host.last_mut()
        {
            *b ^= 0x40;
        }
        self.send(&host, deadline)?;
        self.buffer_sends.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

impl PipeConnector for InProcessConnector {
    fn describe(&self) -> String {
        "in-process pipes".into()
    }

    /// Stands in for NCCL (the tests' pipes).
    fn transport(&self) -> Transport {
        Transport::Nccl
    }

    fn device_uuid(&self) -> Option<[u8; 16]> {
        *self.uuid.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn new_id(&self) -> std::result::Result<Vec<u8>, String> {
        let id = rand::random::<u128>().to_le_bytes().to_vec();
        let (a_tx, b_rx) = std::sync::mpsc::channel();
        let (b_tx, a_rx) = std::sync::mpsc::channel();
        let halves = [Some(Half { tx: a_tx, rx: a_rx }), Some(Half { tx: b_tx, rx: b_rx })];
        self.waiting.lock().unwrap_or_else(|p| p.into_inner()).insert(id.clone(), halves);
        Ok(id)
    }

    fn connect_timeout(&self) -> Duration {
        match self.connect_timeout_ms.load(std::sync::atomic::Ordering::Relaxed) {
            0 => Duration::from_secs(10),
            ms => Duration::from_millis(ms),
        }
    }

    fn connect(&self, id: &[u8], rank: u32, timeout: Duration) -> std::result::Result<Box<dyn BytePipe>, String> {
        let refuse = rank == 1 && self.refuse_join.load(std::sync::atomic::Ordering::Relaxed);
        let deadline = Instant::now() + timeout;
        let mut w = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        let half = if refuse {
            None
        } else {
            w.get_mut(id).ok_or("unknown rendezvous id")?[rank as usize & 1].take()
        };
        self.joined.notify_all();
        // Both ranks must join before either returns (as ncclCommInitRank). An id no longer
        // waiting was completed by the other rank.
        loop {
            let both = w.get(id).is_none_or(|h| h.iter().all(Option::is_none));
            if both && half.is_some() {
                break;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                w.remove(id);
                return Err(format!("the other rank did not join within {} ms", timeout.as_millis()));
            }
            w = self.joined.wait_timeout(w, left).unwrap_or_else(|p| p.into_inner()).0;
        }
        w.remove(id);
        drop(w);
        let sends_left = if rank == 0 { self.fail_after_sends.lock().unwrap_or_else(|p| p.into_inner()).take() } else { None };
        Ok(Box::new(InProcessPipe { half: half.expect("checked"), sends_left, buffer_sends: self.buffer_sends.clone(), corrupt_buffers: self.corrupt_buffers.clone() }))
    }
}
