//! The one receive loop: read an event from a link, feed it to the [`Inbound`] state machine, do
//! what it says. The gRPC stream, the TCP connection and the device pipe differ only in their
//! [`InboundLink`] (how they read a frame, read a chunk's bytes in place, and send a reply).
//!
//! [`Session`] is the state machine with its side effects on this worker: the claim of an
//! admitted transfer, the failure told to the request waiting for it, and the delivery of a
//! finished payload, acknowledged only once the request imported it (so the prefill side's
//! lease covers the whole handoff).

use super::assembler::Target;
use super::inbound::{Action, After, Event, Inbound, Link};
use super::transfers::{Delivery, KvReceiver, Waiter};
use crate::error::{Result, WorkerError};
use crate::kv::chunks::Chunk;
use crate::kv::replies::kv_error;
use ferry_engine::KvBuffer;
use ferry_proto::v1::{kv_ack_frame, KvAck, KvAckFrame};
use tokio::sync::oneshot;

/// One way transfers arrive.
pub(crate) trait InboundLink {
    /// Read the next frame or message as an event (or what stopped reading: a close, a stall,
    /// a failure). `idle`: no transfer is under way (a pipe may wait longer).
    async fn next(&mut self, idle: bool) -> Event;
    /// Read chunk `c`'s bytes into `target`: [`Event::Landed`], or what went wrong.
    async fn take(&mut self, c: Chunk, target: Target<'_>) -> Event;
    /// Read and drop chunk `c`'s bytes: [`Event::Landed`], or what went wrong.
    async fn skip(&mut self, c: Chunk) -> Event;
    /// A buffer for a payload body of `len` bytes, where this link delivers buffer frames.
    fn alloc(&mut self, len: usize) -> std::result::Result<KvBuffer, String> {
        Ok(KvBuffer::Host(vec![0; len]))
    }
    /// Answer the sender.
    async fn reply(&mut self, reply: KvAckFrame) -> Result<()>;
}

/// The state machine with this worker's side of it: claims, notices, deliveries.
pub(crate) struct Session<'a> {
    receiver: &'a KvReceiver,
    machine: Inbound,
    /// The request waiting for the transfer under way (none in sink mode, or before a claim).
    waiter: Option<Waiter>,
}

impl<'a> Session<'a> {
    pub(crate) fn new(receiver: &'a KvReceiver, link: Link) -> Self {
        Session { receiver, machine: Inbound::new(link), waiter: None }
    }

    /// Feed `ev`; a claim is answered here, and a failure told to the waiting request. What is
    /// left is for the driver.
    fn feed(&mut self, ev: Event) -> Action {
        let mut action = self.machine.on(ev);
        loop {
            match action {
                Action::Claim { id, token, header } => {
                    let ev = match self.receiver.claim(id, &token, header) {
                        Ok((want, buf, waiter)) => {
                            self.waiter = waiter;
                            Event::Admitted { want, buf }
                        }
                        Err(e) => Event::Refused(e),
                    };
                    action = self.machine.on(ev);
                }
                Action::Fail { ref error, .. } => {
                    if let Some(w) = self.waiter.take() {
                        let _ = w.send(Err(error.status()));
                    }
                    return action;
                }
                other => return other,
            }
        }
    }

    /// Hand a finished payload to its request and wait until it imported it; the outcome is
    /// the reply. In sink mode (no request) the buffer goes back to the pool.
    async fn deliver(&mut self, assembled: super::assembler::Assembled) -> Result<KvAck> {
        let (bytes, chunks) = (assembled.payload.len() as u64, assembled.chunks);
        let Some(waiter) = self.waiter.take() else {
            self.receiver.buffers.give(assembled.payload);
            return Ok(KvAck { bytes, chunks });
        };
        let (ack_tx, ack_rx) = oneshot::channel();
        waiter.send(Ok(Delivery { assembled, ack: ack_tx })).map_err(|_| WorkerError::Cancelled)?;
        match ack_rx.await {
            Ok(Ok(())) => Ok(KvAck { bytes, chunks }),
            Ok(Err(status)) => Err(WorkerError::PeerRefused { peer: "decode engine".into(), status }),
            Err(_) => Err(WorkerError::Cancelled),
        }
    }
}

/// `f`, unless the sender makes no progress for `stall`: then the stall, as the event that fails
/// the transfer (its buffer goes back to the pool).
pub(crate) async fn before_stall<T>(stall: std::time::Duration, f: impl std::future::Future<Output = T>) -> std::result::Result<T, Event> {
    tokio::time::timeout(stall, f).await.map_err(|_| {
        metrics::counter!(crate::cluster::metrics::names::KV_STALLS, "side" => "receive").increment(1);
        Event::Stalled(stall)
    })
}

/// A transfer's outcome as a reply.
pub(crate) fn reply_of(r: &Result<KvAck>) -> KvAckFrame {
    let result = match r {
        Ok(ack) => kv_ack_frame::Result::Ack(*ack),
        Err(e) => kv_ack_frame::Result::Error(kv_error(e)),
    };
    KvAckFrame { result: Some(result) }
}

/// Receive on `link` until it is done: a stream after its one transfer is answered, a pipe when
/// the sender retires it. An error is a link that failed (a pipe out of step, a reply that
/// could not be sent).
pub(crate) async fn drive(session: &mut Session<'_>, link: &mut impl InboundLink) -> Result<()> {
    loop {
        let ev = link.next(session.machine.idle()).await;
        let mut action = session.feed(ev);
        loop {
            action = match action {
                Action::Next => break,
                Action::Allocate(n) => session.feed(Event::Allocated(link.alloc(n))),
                Action::Take(c) => {
                    let ev = match session.machine.target() {
                        Ok(t) => link.take(c, t).await,
                        Err(e) => Event::Broken(e.to_string()),
                    };
                    session.feed(ev)
                }
                Action::Skip(c) => {
                    let ev = link.skip(c).await;
                    session.feed(ev)
                }
                Action::Deliver(done) => {
                    let outcome = session.deliver(done).await;
                    link.reply(reply_of(&outcome)).await?;
                    break;
                }
                Action::Fail { error, then } => match then {
                    After::Reply => {
                        link.reply(reply_of(&Err(error))).await?;
                        break;
                    }
                    After::Next => break,
                    After::Skip(c) => Action::Skip(c),
                    After::Stop => return Err(error),
                },
                Action::Reply(e) => {
                    link.reply(KvAckFrame { result: Some(kv_ack_frame::Result::Error(e)) }).await?;
                    break;
                }
                Action::Stop => return Ok(()),
                Action::Claim { .. } => return Err(WorkerError::Internal("an unanswered KV claim".into())),
            };
        }
        if session.machine.finished() {
            return Ok(());
        }
    }
}

#[cfg(test)]
#[path = "drive_tests.rs"]
mod tests;
