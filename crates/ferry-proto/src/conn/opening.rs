//! A connection's opening (until its first request head, HTTP/2 preface or TLS handshake is in)
//! and the eviction of connections still opening when the server is at its cap.
//!
//! Holding connections open by sending a request slowly (slowloris) fills any cap; a header
//! timeout alone frees the slots only when it runs out, and until then every new connection,
//! normal ones too, is refused. So at the cap the acceptor closes the connection that has been
//! opening longest to make room for the new one, as HAProxy and nginx do with connections that
//! have sent no complete request: a normal client finishes opening within a round trip and is
//! never a candidate, while the slow ones are.
//!
//! - [`Phase`] tells from the bytes that pass (pure) when a connection has opened: an HTTP/1
//!   request head's blank line; the 24 bytes of the HTTP/2 preface; for TLS (a first byte of
//!   0x16, a handshake record), [`TLS_OPENED_AFTER_SERVER`] bytes from the client after the
//!   server's first write (its handshake answer): the client's finish of the handshake and the
//!   start of its first request.
//! - [`Slot`] holds a connection's place under the cap; [`Slot::evict`] gives the place back at
//!   once and wakes the connection's reader, which then fails and closes it.
//! - [`Openings`] is the acceptor's queue of slots, oldest first.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::Waker;

use tokio::sync::OwnedSemaphorePermit;

/// TLS: bytes the client must send after the server's first write to count as opened (a TLS 1.3
/// client `Finished` record is 58 bytes, the HTTP/2 preface after it 46 or more).
pub const TLS_OPENED_AFTER_SERVER: usize = 100;

/// The first byte of a TLS handshake record.
const TLS_HANDSHAKE: u8 = 0x16;
/// The HTTP/2 client connection preface, `PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`, in bytes.
const H2_PREFACE_LEN: usize = 24;
/// The end of an HTTP/1 request head.
const BLANK_LINE: &[u8; 4] = b"\r\n\r\n";

/// What a server's connections open with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    Http1,
    Http2,
}

/// How far a connection has opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Nothing read yet.
    Start(Protocol),
    /// HTTP/1: the bytes of the blank line ending the head that the last bytes matched.
    Head { matched: usize },
    /// HTTP/2 without TLS: preface bytes still owed.
    Preface { left: usize },
    /// TLS: bytes the client sent after the server's first write (`None`: it has not written).
    Tls { after_server: Option<usize> },
    Open,
}

impl Phase {
    pub fn new(p: Protocol) -> Phase {
        Phase::Start(p)
    }

    pub fn is_open(self) -> bool {
        self == Phase::Open
    }

    /// The client sent `bytes`.
    pub fn read(&mut self, bytes: &[u8]) {
        let Some(&first) = bytes.first() else { return };
        if let Phase::Start(p) = *self {
            *self = match (first, p) {
                (TLS_HANDSHAKE, _) => Phase::Tls { after_server: None },
                (_, Protocol::Http1) => Phase::Head { matched: 0 },
                (_, Protocol::Http2) => Phase::Preface { left: H2_PREFACE_LEN },
            };
        }
        *self = match *self {
            Phase::Head { mut matched } => {
                for &b in bytes {
                    matched = if b == BLANK_LINE[matched] {
                        matched + 1
                    } else if b == b'\r' {
                        1
                    } else {
                        0
                    };
                    if matched == BLANK_LINE.len() {
                        *self = Phase::Open;
                        return;
                    }
                }
                Phase::Head { matched }
            }
            Phase::Preface { left } => match left.saturating_sub(bytes.len()) {
                0 => Phase::Open,
                left => Phase::Preface { left },
            },
            Phase::Tls { after_server: Some(n) } => match n + bytes.len() {
                n if n >= TLS_OPENED_AFTER_SERVER => Phase::Open,
                n => Phase::Tls { after_server: Some(n) },
            },
            other => other,
        };
    }

    /// The server wrote to the client.
    pub fn wrote(&mut self) {
        if let Phase::Tls { after_server: None } = self {
            *self = Phase::Tls { after_server: Some(0) };
        }
    }

    /// What the connection owes, for a log line.
    pub fn owed(self) -> &'static str {
        match self {
            Phase::Start(Protocol::Http1) | Phase::Head { .. } => "a request head",
            Phase::Start(Protocol::Http2) | Phase::Preface { .. } => "the HTTP/2 preface",
            Phase::Tls { .. } => "a TLS handshake and its first request",
            Phase::Open => "nothing",
        }
    }
}

/// One connection's place under its server's cap.
pub struct Slot {
    state: Mutex<SlotState>,
}

struct SlotState {
    permit: Option<OwnedSemaphorePermit>,
    opened: bool,
    evicted: bool,
    /// The connection's reader, to wake when evicted.
    reader: Option<Waker>,
}

impl Slot {
    pub fn new(permit: OwnedSemaphorePermit) -> Arc<Slot> {
        Arc::new(Slot { state: Mutex::new(SlotState { permit: Some(permit), opened: false, evicted: false, reader: None }) })
    }

    fn lock(&self) -> MutexGuard<'_, SlotState> {
        // The state stays consistent whatever panicked while holding it (each field is set alone).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The connection has opened: it is no longer a candidate for eviction.
    pub fn opened(&self) {
        let mut s = self.lock();
        s.opened = true;
        s.reader = None;
    }

    pub fn is_evicted(&self) -> bool {
        self.lock().evicted
    }

    /// Wakes `w` on eviction (the connection's reader is waiting for bytes).
    pub fn park(&self, w: &Waker) {
        let mut s = self.lock();
        if !s.opened && !s.reader.as_ref().is_some_and(|r| r.will_wake(w)) {
            s.reader = Some(w.clone());
        }
    }

    /// Closes the connection to make room if it is still opening: its place is given back now,
    /// and its reader woken to fail. False when it had opened (or was evicted already).
    pub fn evict(&self) -> bool {
        let mut s = self.lock();
        if s.opened || s.evicted {
            return false;
        }
        s.evicted = true;
        s.permit = None;
        if let Some(w) = s.reader.take() {
            w.wake();
        }
        true
    }
}

/// The acceptor's slots in the order they were admitted; those that opened or closed are
/// dropped as they are met.
pub struct Openings {
    queue: VecDeque<Weak<Slot>>,
    /// The queue is pruned of opened and closed slots when it grows past this.
    prune_at: usize,
}

impl Openings {
    pub fn new(max_connections: usize) -> Openings {
        Openings { queue: VecDeque::new(), prune_at: max_connections.saturating_mul(2).saturating_add(16) }
    }

    pub fn push(&mut self, slot: &Arc<Slot>) {
        if self.queue.len() >= self.prune_at {
            self.queue.retain(|w| w.upgrade().is_some_and(|s| !s.lock().opened));
        }
        self.queue.push_back(Arc::downgrade(slot));
    }

    /// Evicts the connection opening longest; false when none is opening.
    pub fn evict_oldest(&mut self) -> bool {
        while let Some(w) = self.queue.pop_front() {
            if w.upgrade().is_some_and(|s| s.evict()) {
                return true;
            }
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::Semaphore;

    fn fed(p: Protocol, chunks: &[&[u8]]) -> Phase {
        let mut ph = Phase::new(p);
        for c in chunks {
            ph.read(c);
        }
        ph
    }

    #[test]
    fn an_http1_head_opens_on_its_blank_line_in_any_split() {
        let head = b"GET / HTTP/1.1\r\nhost: t\r\n\r\n";
        for cut in 0..head.len() {
            let (a, b) = head.split_at(cut);
            assert_eq!(fed(Protocol::Http1, &[a, b]), Phase::Open, "cut at {cut}");
            let partial = fed(Protocol::Http1, &[&head[..cut]]);
            assert!(!partial.is_open(), "open after {cut} bytes");
        }
        // `\r\r\n\r\n` still ends a head; a lone `\n\n` does not (hyper wants CRLF here too).
        assert_eq!(fed(Protocol::Http1, &[b"GET / HTTP/1.1\r\r\n\r\n"]), Phase::Open);
        assert!(!fed(Protocol::Http1, &[b"GET / HTTP/1.1\n\n"]).is_open());
    }

    #[test]
    fn the_http2_preface_opens_after_24_bytes() {
        assert_eq!(fed(Protocol::Http2, &[b"PRI * HTTP/2.0\r\n"]), Phase::Preface { left: 8 });
        assert_eq!(fed(Protocol::Http2, &[b"PRI * HTTP/2.0\r\n", b"\r\nSM\r\n\r\n"]), Phase::Open);
    }

    #[test]
    fn tls_opens_only_after_the_client_answers_the_server() {
        let mut p = Phase::new(Protocol::Http2);
        p.read(&[TLS_HANDSHAKE, 3, 1, 2, 0]);
        p.read(&[0; 500]);
        assert_eq!(p, Phase::Tls { after_server: None }, "a ClientHello alone, however long");
        p.wrote();
        p.read(&[0; TLS_OPENED_AFTER_SERVER - 1]);
        assert!(!p.is_open());
        p.wrote();
        p.read(&[0]);
        assert!(p.is_open());
        // TLS on an HTTP/1 server too.
        assert_eq!(fed(Protocol::Http1, &[&[TLS_HANDSHAKE]]), Phase::Tls { after_server: None });
    }

    #[test]
    fn the_oldest_opening_slot_is_evicted_and_its_place_given_back() {
        let sem = Arc::new(Semaphore::new(3));
        let slot = || Slot::new(sem.clone().try_acquire_owned().unwrap());
        let (a, b, c) = (slot(), slot(), slot());
        let mut q = Openings::new(3);
        for s in [&a, &b, &c] {
            q.push(s);
        }
        a.opened();
        drop(b);
        assert_eq!(sem.available_permits(), 1, "b's drop gave its place back");
        // a opened and b is gone: c is the one evicted.
        assert!(q.evict_oldest());
        assert!(c.is_evicted() && !a.is_evicted());
        assert_eq!(sem.available_permits(), 2, "c's place is free before c is dropped");
        assert!(!q.evict_oldest(), "nothing else is opening");
        assert!(!c.evict(), "evicted once");
    }

    #[test]
    fn an_evicted_reader_is_woken() {
        struct Flag(std::sync::atomic::AtomicBool);
        impl std::task::Wake for Flag {
            fn wake(self: Arc<Self>) {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let flag = Arc::new(Flag(false.into()));
        let sem = Arc::new(Semaphore::new(1));
        let s = Slot::new(sem.try_acquire_owned().unwrap());
        s.park(&Waker::from(flag.clone()));
        assert!(s.evict());
        assert!(flag.0.load(std::sync::atomic::Ordering::SeqCst));
    }
}
