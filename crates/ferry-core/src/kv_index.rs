//! The router's index of where KV blocks live: block hash -> the workers that hold it, kept from
//! the block-stored / block-evicted events each worker publishes (Dynamo's KV router keeps the
//! same kind of index from its engines' KV events; SGLang's router approximates it with a radix
//! tree of what it sent where). Pure data: the caller feeds events and asks for overlaps.
//!
//! Block hashes chain their parents (a block's hash covers every token before it), so a worker
//! holds a request's first `k` blocks exactly when it holds the hash of block `k - 1` and every
//! one before it; [`KvIndex::overlap`] counts that run from the start.
//!
//! Events are numbered per worker from 1. An event whose number is not the next one (a gap: a
//! lost heartbeat, a restarted worker starting again at 1) is not applied: the worker is marked
//! stale, holds nothing as far as routing goes, and [`Applied::NeedResync`] tells the caller to
//! ask it for a full snapshot ([`KvIndex::resync`]). A worker the index has never heard of holds
//! nothing either, so a fresh worker or a restarted router routes on load alone until events
//! arrive.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;

/// What one worker reports about its cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent<H> {
    /// These blocks now hold KV there (full, immutable, shareable).
    Stored(Vec<H>),
    /// These blocks were evicted there.
    Evicted(Vec<H>),
    /// Everything there is gone (the cache was cleared).
    Cleared,
}

/// What [`KvIndex::apply`] did with an event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    Applied,
    /// An event already applied (a repeated heartbeat): ignored.
    Duplicate,
    /// Not the next event: the worker's entries are dropped until a snapshot comes.
    NeedResync,
}

#[derive(Debug)]
struct Held<H> {
    blocks: HashSet<H>,
    /// The number of the last event applied; 0 before the first.
    last_seq: u64,
    /// A gap was seen: its blocks are not trusted until [`KvIndex::resync`].
    stale: bool,
}

impl<H> Default for Held<H> {
    fn default() -> Self {
        Held { blocks: HashSet::new(), last_seq: 0, stale: false }
    }
}

/// Block hash -> workers, and each worker's blocks.
#[derive(Debug)]
pub struct KvIndex<H> {
    holders: HashMap<H, HashSet<String>>,
    workers: HashMap<String, Held<H>>,
}

impl<H> Default for KvIndex<H> {
    fn default() -> Self {
        KvIndex { holders: HashMap::new(), workers: HashMap::new() }
    }
}

impl<H: Copy + Eq + Hash> KvIndex<H> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Apply worker `worker`'s event number `seq` (numbered from 1, one after another).
    pub fn apply(&mut self, worker: &str, seq: u64, event: &KvEvent<H>) -> Applied {
        let Self { holders, workers } = self;
        let held = workers.entry(worker.to_string()).or_default();
        if held.stale {
            return Applied::NeedResync;
        }
        if seq <= held.last_seq {
            return Applied::Duplicate;
        }
        if seq != held.last_seq + 1 {
            drop_all(holders, held, worker);
            held.stale = true;
            return Applied::NeedResync;
        }
        held.last_seq = seq;
        match event {
            KvEvent::Stored(hs) => {
                for &h in hs {
                    hold(holders, held, h, worker);
                }
            }
            KvEvent::Evicted(hs) => {
                for h in hs {
                    if held.blocks.remove(h) {
                        unhold(holders, h, worker);
                    }
                }
            }
            KvEvent::Cleared => drop_all(holders, held, worker),
        }
        Applied::Applied
    }

    /// Replace what `worker` holds with a full snapshot, current as of its event `seq` (the next
    /// event expected is `seq + 1`).
    pub fn resync(&mut self, worker: &str, seq: u64, blocks: impl IntoIterator<Item = H>) {
        let Self { holders, workers } = self;
        let held = workers.entry(worker.to_string()).or_default();
        drop_all(holders, held, worker);
        held.last_seq = seq;
        held.stale = false;
        for h in blocks {
            hold(holders, held, h, worker);
        }
    }

    /// Forget a worker (it deregistered, or died: a restarted worker comes back under a new id).
    pub fn remove_worker(&mut self, worker: &str) {
        if let Some(mut held) = self.workers.remove(worker) {
            drop_all(&mut self.holders, &mut held, worker);
        }
    }

    /// Whether `worker`'s entries wait for a snapshot.
    pub fn needs_resync(&self, worker: &str) -> bool {
        self.workers.get(worker).is_some_and(|h| h.stale)
    }

    /// The number of the last event applied for `worker` (0: none).
    pub fn last_seq(&self, worker: &str) -> u64 {
        self.workers.get(worker).map_or(0, |h| h.last_seq)
    }

    /// How many of `chain`'s leading blocks `worker` holds.
    pub fn overlap(&self, worker: &str, chain: &[H]) -> usize {
        let Some(held) = self.workers.get(worker).filter(|h| !h.stale) else { return 0 };
        chain.iter().take_while(|h| held.blocks.contains(h)).count()
    }

    /// The leading blocks of `chain` each worker that holds any of them holds.
    pub fn overlaps(&self, chain: &[H]) -> HashMap<String, usize> {
        let Some(first) = chain.first() else { return HashMap::new() };
        self.holders.get(first).into_iter().flatten().map(|w| (w.clone(), self.overlap(w, chain))).collect()
    }

    /// Blocks the index has `worker` holding.
    pub fn blocks_of(&self, worker: &str) -> usize {
        self.workers.get(worker).map_or(0, |h| h.blocks.len())
    }

    /// Distinct blocks held anywhere.
    pub fn distinct_blocks(&self) -> usize {
        self.holders.len()
    }

}

fn hold<H: Copy + Eq + Hash>(holders: &mut HashMap<H, HashSet<String>>, held: &mut Held<H>, h: H, worker: &str) {
    if held.blocks.insert(h) {
        holders.entry(h).or_default().insert(worker.to_string());
    }
}

fn unhold<H: Eq + Hash>(holders: &mut HashMap<H, HashSet<String>>, h: &H, worker: &str) {
    if let Some(ws) = holders.get_mut(h) {
        ws.remove(worker);
        if ws.is_empty() {
            holders.remove(h);
        }
    }
}

fn drop_all<H: Eq + Hash>(holders: &mut HashMap<H, HashSet<String>>, held: &mut Held<H>, worker: &str) {
    for h in held.blocks.drain() {
        unhold(holders, &h, worker);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use KvEvent::*;

    #[test]
    fn overlap_counts_the_leading_run_only() {
        let mut ix = KvIndex::new();
        assert_eq!(ix.apply("a", 1, &Stored(vec![1u64, 2, 3])), Applied::Applied);
        assert_eq!(ix.apply("b", 1, &Stored(vec![1, 5])), Applied::Applied);
        assert_eq!(ix.overlap("a", &[1, 2, 3, 4]), 3);
        assert_eq!(ix.overlap("b", &[1, 2, 3, 4]), 1);
        // A hole: block 2 missing means nothing after it counts.
        assert_eq!(ix.overlap("b", &[1, 5]), 2);
        assert_eq!(ix.overlap("nobody", &[1]), 0);
        let o = ix.overlaps(&[1, 2, 3]);
        assert_eq!((o["a"], o["b"], o.len()), (3, 1, 2));
        assert!(ix.overlaps(&[]).is_empty());
        assert_eq!(ix.distinct_blocks(), 4);
    }

    #[test]
    fn evictions_and_clears_remove_only_that_worker_s_blocks() {
        let mut ix = KvIndex::new();
        ix.apply("a", 1, &Stored(vec![1u64, 2, 3]));
        ix.apply("b", 1, &Stored(vec![1, 2]));
        assert_eq!(ix.apply("a", 2, &Evicted(vec![2, 9])), Applied::Applied);
        assert_eq!(ix.overlap("a", &[1, 2, 3]), 1);
        assert_eq!(ix.overlap("b", &[1, 2, 3]), 2);
        assert_eq!(ix.apply("b", 2, &Cleared), Applied::Applied);
        assert_eq!(ix.overlap("b", &[1]), 0);
        assert_eq!(ix.last_seq("b"), 2);
        assert_eq!(ix.apply("b", 3, &Stored(vec![7])), Applied::Applied, "a clear is an ordinary event: numbering goes on");
        assert_eq!((ix.blocks_of("a"), ix.blocks_of("b"), ix.distinct_blocks()), (2, 1, 3));
    }

    #[test]
    fn a_gap_or_a_restart_drops_the_worker_until_a_snapshot() {
        let mut ix = KvIndex::new();
        ix.apply("a", 1, &Stored(vec![1u64, 2]));
        assert_eq!(ix.apply("a", 1, &Stored(vec![1, 2])), Applied::Duplicate);
        // Event 2 lost: 3 is a gap.
        assert_eq!(ix.apply("a", 3, &Stored(vec![3])), Applied::NeedResync);
        assert!(ix.needs_resync("a"));
        assert_eq!(ix.overlap("a", &[1, 2]), 0, "a stale worker holds nothing for routing");
        assert_eq!(ix.apply("a", 4, &Stored(vec![4])), Applied::NeedResync, "still stale until the snapshot");
        ix.resync("a", 4, [1, 2, 3, 4]);
        assert!(!ix.needs_resync("a"));
        assert_eq!(ix.overlap("a", &[1, 2, 3, 4]), 4);
        assert_eq!(ix.apply("a", 5, &Evicted(vec![4])), Applied::Applied);
        assert_eq!(ix.overlap("a", &[1, 2, 3, 4]), 3);
        // A first event that is not 1 (the router restarted mid-stream of events): resync.
        assert_eq!(ix.apply("fresh", 7, &Stored(vec![1])), Applied::NeedResync);
        ix.remove_worker("a");
        assert_eq!((ix.overlap("a", &[1]), ix.distinct_blocks()), (0, 0));
    }

    /// Against a model: random events on a few workers, with gaps, keep `holders` the exact
    /// inverse of the workers' block sets.
    #[test]
    fn the_two_maps_stay_each_other_s_inverse() {
        let mut u = crate::arrivals::uniforms(7);
        let mut ix: KvIndex<u64> = KvIndex::new();
        let mut seqs = [0u64; 3];
        for _ in 0..2000 {
            let w = (u() * 3.0) as usize;
            let name = format!("w{w}");
            let hs: Vec<u64> = (0..1 + (u() * 4.0) as usize).map(|_| (u() * 20.0) as u64).collect();
            let skip = u() < 0.02;
            seqs[w] += if skip { 2 } else { 1 };
            let ev = match (u() * 10.0) as u32 {
                0 => Cleared,
                1..=4 => Evicted(hs),
                _ => Stored(hs),
            };
            if ix.apply(&name, seqs[w], &ev) == Applied::NeedResync && u() < 0.5 {
                ix.resync(&name, seqs[w], [1, 2, 3]);
            }
            for (h, ws) in &ix.holders {
                assert!(!ws.is_empty());
                for w in ws {
                    assert!(ix.workers[w].blocks.contains(h));
                }
            }
            for (w, held) in &ix.workers {
                for h in &held.blocks {
                    assert!(ix.holders[h].contains(w));
                }
                assert!(!held.stale || held.blocks.is_empty());
            }
        }
    }
}
