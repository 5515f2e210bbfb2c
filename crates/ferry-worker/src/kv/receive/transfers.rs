//! The transfers a decode worker admitted and waits for ([`KvReceiver`]): each is claimed by the
//! link its chunks arrive on (the `KvTransfer.PushKv` gRPC stream, [`super::grpc`]; the TCP data
//! path, [`super::tcp`]; the device pipe, [`super::pipe`]), each a thin link under the one
//! receive loop ([`super::drive`]) and its [`super::inbound`] state machine. A finished payload
//! goes to the request that admitted it, which imports it and only then lets the receiver
//! acknowledge (so the prefill side's lease covers the whole handoff).

use super::assembler::{payload_len, tokens_match, Assembled, Expectation};
use crate::error::{Result, WorkerError};
use ferry_core::{KvLayout, KvSpan};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;
use tonic::Status;

/// A complete payload handed to the request that admitted it; `ack` answers the sender.
pub struct Delivery {
    pub assembled: Assembled,
    pub ack: oneshot::Sender<Result<(), Status>>,
}

/// Where an admitted transfer's payload (or its failure) goes: the request waiting for it.
pub(crate) type Waiter = oneshot::Sender<Result<Delivery, Status>>;

struct Pending {
    want: Expectation,
    tx: Waiter,
}

/// Recycled payload buffers. A fresh multi-megabyte allocation costs a page fault per 4 KiB
/// (measured here: 94 MB took 77 ms to fault in, four times the copy itself), so buffers are reused.
#[derive(Default)]
pub struct BufferPool(Mutex<Vec<Vec<u8>>>);

impl BufferPool {
    /// Most buffers kept.
    const KEEP: usize = 8;

    /// The smallest kept buffer that holds `len` bytes, else a new empty one.
    pub fn take(&self, len: usize) -> Vec<u8> {
        let mut v = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let best = v.iter().enumerate().filter(|(_, b)| b.capacity() >= len).min_by_key(|(_, b)| b.capacity()).map(|(i, _)| i);
        match best {
            Some(i) => v.swap_remove(i),
            None => Vec::new(),
        }
    }

    pub fn give(&self, mut buf: Vec<u8>) {
        buf.clear();
        let mut v = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if v.len() < Self::KEEP {
            v.push(buf);
        } else if let Some(smallest) = v.iter_mut().min_by_key(|b| b.capacity()) {
            if smallest.capacity() < buf.capacity() {
                *smallest = buf;
            }
        }
    }
}

pub struct KvReceiver {
    pub buffers: BufferPool,
    fingerprint: String,
    layout: KvLayout,
    pending: Mutex<HashMap<u64, Pending>>,
    next_id: AtomicU64,
    /// Benchmark mode: accept any transfer id with a matching model, validate, discard.
    sink: bool,
}

/// An admitted transfer: the receiving half of its delivery. Dropping it withdraws the transfer.
pub struct Ticket {
    pub id: u64,
    pub rx: oneshot::Receiver<Result<Delivery, Status>>,
    owner: Arc<KvReceiver>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.owner.pending.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.id);
    }
}

impl KvReceiver {
    pub fn new(fingerprint: String, layout: KvLayout) -> Arc<Self> {
        Arc::new(Self { buffers: BufferPool::default(), fingerprint, layout, pending: Mutex::default(), next_id: AtomicU64::new(1), sink: false })
    }

    /// A receiver that validates and discards every transfer (for `ferry bench kv`).
    pub fn sink(fingerprint: String, layout: KvLayout) -> Arc<Self> {
        Arc::new(Self { buffers: BufferPool::default(), fingerprint, layout, pending: Mutex::default(), next_id: AtomicU64::new(1), sink: true })
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Admit a transfer of the KV of a `prompt_tokens`-token prompt, to be accepted only from a
    /// sender that presents `token` (the router's, for this request).
    pub fn expect(self: &Arc<Self>, prompt_tokens: usize, token: String) -> Ticket {
        self.expect_from(prompt_tokens, 0, token)
    }

    /// As [`KvReceiver::expect`], when this worker holds the prompt's first `start` tokens (its
    /// cached prefix): the sender ships tokens `start..prompt_tokens` only.
    pub fn expect_from(self: &Arc<Self>, prompt_tokens: usize, start: usize, token: String) -> Ticket {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let want = Expectation { transfer_token: token, fingerprint: self.fingerprint.clone(), layout: self.layout, prompt_tokens, start };
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).insert(id, Pending { want, tx });
        Ticket { id, rx, owner: self.clone() }
    }

    pub fn pending_count(&self) -> usize {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Claim admitted transfer `id` for a sender presenting `token`: what its request expects,
    /// a buffer sized by `header` (when it parsed), and where the payload goes (none in sink
    /// mode). A wrong token leaves the admitted transfer untouched (the caller may not be its
    /// sender).
    pub(crate) fn claim(&self, id: u64, token: &str, header: Option<KvSpan>) -> Result<(Expectation, Vec<u8>, Option<Waiter>)> {
        let buf = || self.buffers.take(header.as_ref().map_or(0, payload_len));
        if self.sink {
            let (start, tokens) = header.map_or((0, 0), |h| (h.start, h.start + h.header.tokens));
            let want = Expectation { transfer_token: token.to_string(), fingerprint: self.fingerprint.clone(), layout: self.layout, prompt_tokens: tokens, start };
            return Ok((want, buf(), None));
        }
        let p = {
            let mut map = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            let p = map.get(&id).ok_or(WorkerError::UnknownTransfer(id))?;
            if !tokens_match(&p.want.transfer_token, token) {
                return Err(WorkerError::BadTransferToken(id));
            }
            map.remove(&id).expect("present")
        };
        Ok((p.want, buf(), Some(p.tx)))
    }
}
