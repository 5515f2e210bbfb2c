//! The receiving side of a KV transfer as one pure state machine, whatever carries it: the gRPC
//! `PushKv` stream, the TCP data path and the device pipe all turn what they read into an
//! [`Event`], feed it to [`Inbound::on`], and do the [`Action`] it returns (read a chunk's bytes
//! where it says, claim the admitted transfer, deliver, reply). No I/O here: the drivers
//! ([`super::drive`]) do that, and every transition is tested from a table below.
//!
//! ```text
//!              Begin                 Admitted               End (all bytes)
//! AwaitBegin ────────▶ Claiming ─────────────▶ Receiving ─────────────────▶ Deliver
//!     ▲                    │ Refused         │ ▲  Chunk ─▶ [Allocate] ─▶ Take ─▶ Landed
//!     │                    ▼                 ▼ │
//!     │   (pipe) ◀──── Draining ◀──────── any failure ────▶ Finished (stream: reply, stop)
//!     └── End: Reply ──────┘ (a pipe drops frames until `end`, so it stays in step)
//! ```
//!
//! A [`Link::Stream`] (gRPC, TCP) carries one transfer and answers the first failure at once. A
//! [`Link::Pipe`] carries transfers one after another on messages whose sizes both sides must
//! agree on: a failure is told to the waiting request at once, but the pipe keeps reading (and
//! dropping) the transfer's frames until its `end`, and replies then.

use super::assembler::{self, Assembled, Expectation, KvAssembler, Target};
use crate::error::WorkerError;
use crate::kv::chunks::Chunk;
use crate::kv::replies::kv_error;
use ferry_core::KvSpan;
use ferry_engine::KvBuffer;
use ferry_proto::v1::{KvBegin, KvEnd, KvError};
use std::time::Duration;

/// What carries the transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Link {
    /// One transfer per stream (gRPC `PushKv`, a TCP connection): fail fast.
    Stream,
    /// Transfers one after another on a pipe that must stay in step (NCCL).
    Pipe,
}

/// What the driver read, or what stopped it reading.
pub enum Event {
    Begin { id: u64, begin: KvBegin },
    /// The claim of [`Action::Claim`] succeeded: what the request expects, and a buffer to
    /// assemble into.
    Admitted { want: Expectation, buf: Vec<u8> },
    /// The claim failed (no such transfer, a wrong token).
    Refused(WorkerError),
    Chunk(Chunk),
    /// The body buffer of [`Action::Allocate`], or why there is none.
    Allocated(Result<KvBuffer, String>),
    /// The bytes of the chunk taken (or skipped) last are in place.
    Landed,
    End(KvEnd),
    /// The sender gave up on the transfer; no reply is expected.
    Abort,
    /// The sender retires the link between transfers.
    Close,
    /// A frame or message that does not parse (its boundaries are intact).
    Malformed(String),
    /// The sender closed the stream.
    Closed,
    /// Nothing arrived for this long.
    Stalled(Duration),
    /// Reading failed; the link is unusable.
    Broken(String),
}

/// What the driver does next.
pub enum Action {
    /// Read the next frame or message.
    Next,
    /// Claim admitted transfer `id` for a sender presenting `token`; `header` (when it parsed)
    /// sizes the buffer. Answer with [`Event::Admitted`] or [`Event::Refused`].
    Claim { id: u64, token: String, header: Option<KvSpan> },
    /// Allocate the body buffer of this many bytes; answer with [`Event::Allocated`].
    Allocate(usize),
    /// Read the chunk's bytes into [`Inbound::target`], then [`Event::Landed`].
    Take(Chunk),
    /// Read and drop the chunk's bytes (the transfer failed; the link stays in step), then
    /// [`Event::Landed`].
    Skip(Chunk),
    /// The payload is complete and valid: hand it to its request, and reply with the outcome.
    Deliver(Assembled),
    /// The transfer failed: its request (if claimed) learns `error` now; then `then`.
    Fail { error: WorkerError, then: After },
    /// A failed transfer ended (its request already knows): answer the sender.
    Reply(KvError),
    /// The link is done.
    Stop,
}

/// What follows a failure.
#[derive(Debug, PartialEq, Eq)]
pub enum After {
    /// Answer the sender with the error now.
    Reply,
    /// Keep reading (a pipe drains the transfer until its `end`).
    Next,
    /// Drop this chunk's bytes, then keep reading.
    Skip(Chunk),
    /// The link is unusable: close it (no reply can get through).
    Stop,
}

enum State {
    AwaitBegin,
    /// Waiting for the claim; the header decoded once, here.
    Claiming { id: u64, begin: KvBegin, header: Result<KvSpan, WorkerError> },
    /// `taking`: the chunk whose bytes the driver is reading.
    Receiving { asm: KvAssembler, taking: Option<Chunk> },
    /// Failed; its frames are dropped until `end`, answered with this error (pipes only).
    Draining(KvError),
    /// Answered; nothing more (streams only).
    Finished,
}

/// One link's inbound transfer(s).
pub struct Inbound {
    link: Link,
    state: State,
}

impl Inbound {
    pub fn new(link: Link) -> Self {
        Inbound { link, state: State::AwaitBegin }
    }

    /// Between transfers (a pipe waits longer here).
    pub fn idle(&self) -> bool {
        matches!(self.state, State::AwaitBegin)
    }

    /// A stream's transfer was answered: stop reading.
    pub fn finished(&self) -> bool {
        matches!(self.state, State::Finished)
    }

    /// Where the bytes of the chunk in [`Action::Take`] go.
    pub fn target(&mut self) -> Result<Target<'_>, WorkerError> {
        match &mut self.state {
            State::Receiving { asm, taking: Some(c) } => asm.target(c),
            _ => Err(WorkerError::Internal("no KV chunk is being taken".into())),
        }
    }

    pub fn on(&mut self, ev: Event) -> Action {
        let state = std::mem::replace(&mut self.state, State::Finished);
        match (state, ev) {
            (State::Finished, _) => Action::Stop,
            (_, Event::Stalled(d)) => self.broken(peer_gone(format!("stalled: no chunk for {} ms", d.as_millis()))),
            (_, Event::Broken(e)) => self.broken(peer_gone(e)),

            (State::AwaitBegin, Event::Begin { id, begin }) => {
                let header = assembler::header(id, &begin);
                let claim = Action::Claim { id, token: begin.transfer_token.clone(), header: header.as_ref().ok().copied() };
                self.state = State::Claiming { id, begin, header };
                claim
            }
            (State::AwaitBegin, Event::Close) => Action::Stop,
            (State::AwaitBegin, Event::Abort) => match self.link {
                Link::Stream => Action::Stop,
                Link::Pipe => self.rest(Action::Next),
            },
            (State::AwaitBegin, Event::End(_)) => self.fail_at_end(malformed("`end` before `begin`")),
            (State::AwaitBegin, Event::Malformed(m)) => self.fail(malformed(&m), None),
            (State::AwaitBegin, Event::Closed) => self.broken(peer_gone("the sender closed the link before `begin`".into())),
            (State::AwaitBegin, Event::Chunk(_)) => self.out_of_place("data before `begin`"),

            (State::Claiming { id, begin, header }, Event::Admitted { want, buf }) => {
                match header.and_then(|h| KvAssembler::begin(id, &begin, &h, &want, buf)) {
                    Ok(asm) => {
                        self.state = State::Receiving { asm, taking: None };
                        Action::Next
                    }
                    Err(e) => self.fail(e, None),
                }
            }
            (State::Claiming { .. }, Event::Refused(e)) => self.fail(e, None),

            (State::Receiving { asm, taking: None }, Event::Chunk(c)) => match asm.accept(&c) {
                Ok(()) => {
                    let action = if asm.needs_buffer(&c) { Action::Allocate(asm.body_len()) } else { Action::Take(c) };
                    self.state = State::Receiving { asm, taking: Some(c) };
                    action
                }
                Err(e) => self.fail(e, Some(c)),
            },
            (State::Receiving { mut asm, taking: Some(c) }, Event::Allocated(buf)) => {
                let id = asm.id();
                let body = asm.body_len();
                let set = buf
                    .map_err(|e| WorkerError::Exhausted(format!("transfer {id}: cannot allocate its {body}-byte KV body: {e}")))
                    .and_then(|b| asm.set_buffer(b));
                match set {
                    Ok(()) => {
                        self.state = State::Receiving { asm, taking: Some(c) };
                        Action::Take(c)
                    }
                    Err(e) => self.fail(e, Some(c)),
                }
            }
            (State::Receiving { mut asm, taking: Some(c) }, Event::Landed) => match asm.commit(&c) {
                Ok(()) => {
                    self.state = State::Receiving { asm, taking: None };
                    Action::Next
                }
                Err(e) => self.fail(e, None),
            },
            (State::Receiving { asm, taking: None }, Event::End(end)) => match asm.finish(end) {
                Ok(done) => self.rest(Action::Deliver(done)),
                Err(e) => self.fail_at_end(e),
            },
            (State::Receiving { .. }, Event::Abort) => {
                let error = peer_gone("the sender abandoned the transfer".into());
                let then = if self.link == Link::Pipe { After::Next } else { After::Stop };
                self.rest(Action::Fail { error, then })
            }
            (State::Receiving { taking: None, .. }, Event::Malformed(m)) => self.fail(malformed(&m), None),
            (State::Receiving { .. }, Event::Closed) => self.broken(peer_gone("the sender closed the link before `end`".into())),
            (State::Receiving { taking: None, .. }, Event::Begin { .. }) => self.out_of_place("a second `begin` inside a transfer"),
            (State::Receiving { taking: None, .. }, Event::Close) => self.out_of_place("`close` inside a transfer"),

            (State::Draining(e), Event::Chunk(c)) => {
                self.state = State::Draining(e);
                Action::Skip(c)
            }
            (State::Draining(e), Event::Landed | Event::Malformed(_)) => {
                self.state = State::Draining(e);
                Action::Next
            }
            (State::Draining(e), Event::End(_)) => self.rest(Action::Reply(e)),
            (State::Draining(_), Event::Abort) => self.rest(Action::Next),
            (State::Draining(_), Event::Closed) => self.broken(peer_gone("the sender closed the link before `end`".into())),
            (State::Draining(_), Event::Begin { .. } | Event::Close) => self.out_of_place("a control frame before the failed transfer's `end`"),

            // What only a driver's own mistake can produce (an answer to nothing asked).
            (_, ev) => self.broken(WorkerError::Internal(format!("KV transfer: {} out of order", name(&ev)))),
        }
    }

    /// The transfer is over (delivered, abandoned or answered): a pipe waits for the next one.
    fn rest(&mut self, action: Action) -> Action {
        self.state = match self.link {
            Link::Stream => State::Finished,
            Link::Pipe => State::AwaitBegin,
        };
        action
    }

    /// The transfer failed inside: a stream answers now, a pipe drains it (dropping `skip`'s
    /// bytes first) and answers at its `end`.
    fn fail(&mut self, error: WorkerError, skip: Option<Chunk>) -> Action {
        match self.link {
            Link::Stream => {
                self.state = State::Finished;
                Action::Fail { error, then: After::Reply }
            }
            Link::Pipe => {
                self.state = State::Draining(kv_error(&error));
                Action::Fail { error, then: skip.map_or(After::Next, After::Skip) }
            }
        }
    }

    /// The transfer failed at its `end`: answer now.
    fn fail_at_end(&mut self, error: WorkerError) -> Action {
        self.rest(Action::Fail { error, then: After::Reply })
    }

    /// The link failed: a stream still tries to answer, a pipe is out of step and closes.
    fn broken(&mut self, error: WorkerError) -> Action {
        self.state = State::Finished;
        let then = if self.link == Link::Stream { After::Reply } else { After::Stop };
        Action::Fail { error, then }
    }

    /// A frame that makes no sense where it is: the sender does not follow the protocol.
    fn out_of_place(&mut self, what: &str) -> Action {
        self.broken(malformed(what))
    }
}

fn malformed(what: &str) -> WorkerError {
    WorkerError::InvalidRequest(format!("malformed KV transfer: {what}"))
}

fn peer_gone(what: String) -> WorkerError {
    WorkerError::PeerUnavailable { peer: "prefill worker".into(), what }
}

fn name(ev: &Event) -> &'static str {
    match ev {
        Event::Begin { .. } => "begin",
        Event::Admitted { .. } => "an admission",
        Event::Refused(_) => "a refusal",
        Event::Chunk(_) => "a chunk",
        Event::Allocated(_) => "an allocation",
        Event::Landed => "a landed chunk",
        Event::End(_) => "end",
        Event::Abort => "abort",
        Event::Close => "close",
        Event::Malformed(_) => "a malformed frame",
        Event::Closed => "a closed link",
        Event::Stalled(_) => "a stall",
        Event::Broken(_) => "a broken link",
    }
}

#[cfg(test)]
#[path = "inbound_tests.rs"]
mod tests;
