//! A sequence as an owned value ([`Sequence`]): dropping it gives its KV blocks back, so no path
//! (a failed import, a cancelled request, an early return, an unwinding panic) can forget them.
//! Text-generation-inference's block allocations return their blocks on `Drop` the same way.
//!
//! The engine is owned by one thread and mutated through `&mut`, so a `Drop` cannot borrow it.
//! A handle carries its [`SeqId`] and a sender to the engine's return channel instead: dropping
//! it sends the id, and the engine frees whatever came back at the start of every call that
//! allocates or steps (new sequences, imports, forks, steps) and whenever asked
//! ([`Engine::reclaim`], which a worker calls before it reads [`Engine::free_blocks`]). A caller
//! that must see the blocks back at once gives the handle to [`Engine::release_now`].
//!
//! A channel rather than a shared list under a lock: the handles only ever send and the engine
//! alone receives (one owner of the pool), and a handle dropped on another thread (a prefill
//! lease held by a transfer task) sends without waiting on the engine thread.
//!
//! [`Engine::release`] stays for callers that hold bare [`SeqId`]s (benchmarks, `generate`).

use super::{Engine, SeqId};
use crate::backend::Backend;
use crate::error::Result;
use std::sync::mpsc::{channel, Receiver, Sender};

/// A sequence's KV blocks, held: dropping the handle gives them back to the engine that made it.
pub struct Sequence {
    id: SeqId,
    /// None once handed to [`Engine::release_now`].
    returns: Option<Sender<SeqId>>,
}

impl Sequence {
    /// The engine's id of this sequence (for [`crate::StepItem`], imports, exports).
    pub fn id(&self) -> SeqId {
        self.id
    }
}

impl std::fmt::Debug for Sequence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sequence({})", self.id.0)
    }
}

impl Drop for Sequence {
    fn drop(&mut self) {
        if let Some(tx) = self.returns.take() {
            // The engine is gone: its pool went with it, nothing to give back.
            let _ = tx.send(self.id);
        }
    }
}

/// The engine's end of the handles' return channel.
pub(crate) struct Returns {
    tx: Sender<SeqId>,
    rx: Receiver<SeqId>,
}

impl Default for Returns {
    fn default() -> Self {
        let (tx, rx) = channel();
        Returns { tx, rx }
    }
}

impl<B: Backend> Engine<B> {
    /// Hold `seq` as a [`Sequence`]: its blocks come back when the handle is dropped. Take a
    /// sequence into a handle as soon as it is made (`let id = engine.new_sequence();
    /// let seq = engine.own(id);`), before anything can return early.
    pub fn own(&self, seq: SeqId) -> Sequence {
        Sequence { id: seq, returns: Some(self.returns.tx.clone()) }
    }

    /// Free `seq`'s blocks now (a caller that counts them next, or allocates elsewhere).
    pub fn release_now(&mut self, mut seq: Sequence) -> Result<()> {
        seq.returns = None;
        self.release(seq.id)
    }

    /// Free the blocks of every handle dropped since the last call; returns how many sequences
    /// that freed. Every call that allocates or steps starts with it.
    pub fn reclaim(&mut self) -> usize {
        let mut n = 0;
        while let Ok(id) = self.returns.rx.try_recv() {
            // An id released by hand meanwhile (`release` on a handle's id) is already gone.
            if self.release(id).is_ok() {
                n += 1;
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use crate::{Engine, EngineConfig, Logits, StepItem};
    use std::path::PathBuf;

    /// The smallest golden model (`tests/fixtures/golden/llama-gqa`, or under `FERRY_FIXTURES`).
    fn engine(prefix_cache: bool) -> Engine {
        let fixtures = match std::env::var_os("FERRY_FIXTURES") {
            Some(p) => PathBuf::from(p),
            None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"),
        };
        let cfg = EngineConfig { threads: 1, block_size: 4, kv_tokens: Some(256), prefix_cache, ..Default::default() };
        Engine::load(&fixtures.join("golden/llama-gqa"), &cfg).expect("load the golden model")
    }

    /// A prompt ending inside a block, so that a fork copies that block.
    const PROMPT: [u32; 7] = [1, 5, 9, 13, 17, 21, 25];

    #[test]
    fn dropping_handles_frees_their_blocks_fork_included() {
        for prefix_cache in [false, true] {
            let mut e = engine(prefix_cache);
            let start = e.free_blocks();
            let id = e.new_sequence();
            let seq = e.own(id);
            e.prefill(seq.id(), &PROMPT).expect("prefill");
            let fork = e.fork(seq.id()).expect("fork");
            let fork = e.own(fork);
            // Seven tokens in blocks of four: the full block is shared, the partial one copied.
            assert_eq!(e.free_blocks(), start - 3, "prefix cache {prefix_cache}");
            e.step(&[StepItem { seq: fork.id(), tokens: &[3], logits: Logits::None }], &mut |_, _| {}).expect("decode the fork");
            assert_eq!(e.active_sequences(), 2);
            drop(seq);
            drop(fork);
            // Returned at the engine's next call that allocates or steps, or when reclaimed.
            assert_eq!(e.reclaim(), 2);
            assert_eq!(e.free_blocks(), start, "prefix cache {prefix_cache}");
            assert_eq!(e.active_sequences(), 0);
            assert_eq!(e.reclaim(), 0, "each handle returns its blocks once");
        }
    }

    #[test]
    fn a_dropped_handle_is_reclaimed_by_the_next_allocation_and_release_now_is_immediate() {
        let mut e = engine(false);
        let start = e.free_blocks();
        let id = e.new_sequence();
        let seq = e.own(id);
        e.prefill(seq.id(), &PROMPT).expect("prefill");
        drop(seq);
        let id = e.new_sequence();
        let next = e.own(id);
        assert_eq!(e.active_sequences(), 1, "the dropped sequence went at the next allocation");
        assert_eq!(e.free_blocks(), start);
        e.prefill(next.id(), &PROMPT).expect("prefill");
        assert!(e.free_blocks() < start);
        e.release_now(next).expect("release now");
        assert_eq!(e.free_blocks(), start);
        assert_eq!(e.reclaim(), 0, "a handle released now sends nothing back");
        // A handle outliving its engine drops quietly.
        let id = e.new_sequence();
        let orphan = e.own(id);
        drop(e);
        drop(orphan);
    }
}
