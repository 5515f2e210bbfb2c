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
//!
//! Two tiers (issue 38): a worker keeps blocks in its pool (memory) and, with `--kv-disk`, in
//! files on local disk, which it loads instead of computing. Each event names its [`KvTier`]; a
//! block may be in both (the worker writes pool blocks through to disk, and a pool eviction leaves
//! the disk copy). The usable prefix is the leading run of blocks held in *either* tier;
//! [`Overlap`] says how many of that run are in the pool and how many only on disk, so routing can
//! price a disk hit (reading) between a pool hit (free) and a miss (computing).

use std::collections::{HashMap, HashSet};
use std::hash::Hash;

/// Where a worker holds a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KvTier {
    /// The KV block pool in memory: attached at no cost.
    Pool,
    /// Block files on the worker's local disk: loaded instead of computed.
    Disk,
}

impl KvTier {
    pub const ALL: [KvTier; 2] = [KvTier::Pool, KvTier::Disk];

    pub fn as_str(self) -> &'static str {
        match self {
            KvTier::Pool => "pool",
            KvTier::Disk => "disk",
        }
    }
}

impl std::fmt::Display for KvTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one worker reports about its cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent<H> {
    /// These blocks now hold KV there, in that tier (full, immutable, shareable).
    Stored(KvTier, Vec<H>),
    /// These blocks left that tier there (a copy in the other tier stays).
    Evicted(KvTier, Vec<H>),
    /// Everything there is gone, in both tiers (the cache was cleared).
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

/// The leading run of a chain's blocks a worker holds in either tier: `pool` of them in its pool,
/// `disk` only on its disk (a block in both counts as pool).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Overlap {
    pub pool: usize,
    pub disk: usize,
}

impl Overlap {
    /// Blocks of the run, whatever the tier.
    pub fn total(self) -> usize {
        self.pool + self.disk
    }

    /// The tier that holds most of the run (pool on a tie); None for an empty run.
    pub fn main_tier(self) -> Option<KvTier> {
        match (self.pool, self.disk) {
            (0, 0) => None,
            (p, d) if d > p => Some(KvTier::Disk),
            _ => Some(KvTier::Pool),
        }
    }
}

#[derive(Debug)]
struct Held<H> {
    pool: HashSet<H>,
    disk: HashSet<H>,
    /// The number of the last event applied; 0 before the first.
    last_seq: u64,
    /// A gap was seen: its blocks are not trusted until [`KvIndex::resync`].
    stale: bool,
}

impl<H> Default for Held<H> {
    fn default() -> Self {
        Held { pool: HashSet::new(), disk: HashSet::new(), last_seq: 0, stale: false }
    }
}

impl<H: Eq + Hash> Held<H> {
    fn tier(&mut self, tier: KvTier) -> &mut HashSet<H> {
        match tier {
            KvTier::Pool => &mut self.pool,
            KvTier::Disk => &mut self.disk,
        }
    }

    fn holds(&self, h: &H) -> bool {
        self.pool.contains(h) || self.disk.contains(h)
    }
}

/// Block hash -> workers (holding it in either tier), and each worker's blocks per tier.
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
            KvEvent::Stored(tier, hs) => {
                for &h in hs {
                    hold(holders, held, *tier, h, worker);
                }
            }
            KvEvent::Evicted(tier, hs) => {
                for h in hs {
                    if held.tier(*tier).remove(h) && !held.holds(h) {
                        unhold(holders, h, worker);
                    }
                }
            }
            KvEvent::Cleared => drop_all(holders, held, worker),
        }
        Applied::Applied
    }

    /// Replace what `worker` holds with a full snapshot of both tiers, current as of its event
    /// `seq` (the next event expected is `seq + 1`).
    pub fn resync(&mut self, worker: &str, seq: u64, pool: impl IntoIterator<Item = H>, disk: impl IntoIterator<Item = H>) {
        let Self { holders, workers } = self;
        let held = workers.entry(worker.to_string()).or_default();
        drop_all(holders, held, worker);
        held.last_seq = seq;
        held.stale = false;
        for h in pool {
            hold(holders, held, KvTier::Pool, h, worker);
        }
        for h in disk {
            hold(holders, held, KvTier::Disk, h, worker);
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

    /// The leading run of `chain`'s blocks `worker` holds in either tier, split by tier.
    pub fn overlap(&self, worker: &str, chain: &[H]) -> Overlap {
        let Some(held) = self.workers.get(worker).filter(|h| !h.stale) else { return Overlap::default() };
        let mut o = Overlap::default();
        for h in chain {
            if held.pool.contains(h) {
                o.pool += 1;
            } else if held.disk.contains(h) {
                o.disk += 1;
            } else {
                break;
            }
        }
        o
    }

    /// The leading blocks of `chain` each worker that holds any of them holds.
    pub fn overlaps(&self, chain: &[H]) -> HashMap<String, Overlap> {
        let Some(first) = chain.first() else { return HashMap::new() };
        self.holders.get(first).into_iter().flatten().map(|w| (w.clone(), self.overlap(w, chain))).collect()
    }

    /// Blocks the index has `worker` holding in `tier`.
    pub fn blocks_of(&self, worker: &str, tier: KvTier) -> usize {
        self.workers.get(worker).map_or(0, |h| match tier {
            KvTier::Pool => h.pool.len(),
            KvTier::Disk => h.disk.len(),
        })
    }

    /// Distinct blocks held anywhere, in either tier.
    pub fn distinct_blocks(&self) -> usize {
        self.holders.len()
    }
}

fn hold<H: Copy + Eq + Hash>(holders: &mut HashMap<H, HashSet<String>>, held: &mut Held<H>, tier: KvTier, h: H, worker: &str) {
    let new = !held.holds(&h);
    if held.tier(tier).insert(h) && new {
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
    // A block in both tiers is unheld twice: the second time finds nothing.
    for h in held.pool.drain().chain(held.disk.drain()) {
        unhold(holders, &h, worker);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use KvEvent::*;
    use KvTier::{Disk, Pool};

    fn o(pool: usize, disk: usize) -> Overlap {
        Overlap { pool, disk }
    }

    #[test]
    fn overlap_counts_the_leading_run_only() {
        let mut ix = KvIndex::new();
        assert_eq!(ix.apply("a", 1, &Stored(Pool, vec![1u64, 2, 3])), Applied::Applied);
        assert_eq!(ix.apply("b", 1, &Stored(Pool, vec![1, 5])), Applied::Applied);
        assert_eq!(ix.overlap("a", &[1, 2, 3, 4]), o(3, 0));
        assert_eq!(ix.overlap("b", &[1, 2, 3, 4]), o(1, 0));
        // A hole: block 2 missing means nothing after it counts.
        assert_eq!(ix.overlap("b", &[1, 5]), o(2, 0));
        assert_eq!(ix.overlap("nobody", &[1]), o(0, 0));
        let ov = ix.overlaps(&[1, 2, 3]);
        assert_eq!((ov["a"], ov["b"], ov.len()), (o(3, 0), o(1, 0), 2));
        assert!(ix.overlaps(&[]).is_empty());
        assert_eq!(ix.distinct_blocks(), 4);
    }

    /// The run over both tiers: (pool blocks, disk blocks, chain) -> the overlap.
    #[test]
    fn overlap_by_tier_table() {
        let cases: Vec<(&str, Vec<u64>, Vec<u64>, Vec<u64>, Overlap)> = vec![
            ("pool only", vec![1, 2, 3], vec![], vec![1, 2, 3, 4], o(3, 0)),
            ("disk only", vec![], vec![1, 2, 3], vec![1, 2, 3, 4], o(0, 3)),
            ("in both counts as pool", vec![1, 2], vec![1, 2, 3], vec![1, 2, 3], o(2, 1)),
            ("interleaved", vec![1, 3], vec![2, 4], vec![1, 2, 3, 4, 5], o(2, 2)),
            ("disk first, then pool", vec![3, 4], vec![1, 2], vec![1, 2, 3, 4], o(2, 2)),
            ("a hole in both ends the run", vec![1, 4], vec![2, 5], vec![1, 2, 3, 4, 5], o(1, 1)),
            ("a hole at the start", vec![2], vec![3], vec![1, 2, 3], o(0, 0)),
            ("empty chain", vec![1], vec![2], vec![], o(0, 0)),
        ];
        for (name, pool, disk, chain, want) in cases {
            let mut ix = KvIndex::new();
            ix.apply("w", 1, &Stored(Pool, pool.clone()));
            ix.apply("w", 2, &Stored(Disk, disk.clone()));
            assert_eq!(ix.overlap("w", &chain), want, "{name}");
            // A snapshot of the same sets gives the same answer.
            let mut snap = KvIndex::new();
            snap.resync("w", 2, pool, disk);
            assert_eq!(snap.overlap("w", &chain), want, "{name} (snapshot)");
        }
    }

    #[test]
    fn overlap_main_tier() {
        assert_eq!(o(0, 0).main_tier(), None);
        assert_eq!(o(3, 0).main_tier(), Some(Pool));
        assert_eq!(o(2, 2).main_tier(), Some(Pool), "a tie is the pool's");
        assert_eq!(o(1, 4).main_tier(), Some(Disk));
        assert_eq!(o(1, 4).total(), 5);
    }

    #[test]
    fn a_pool_eviction_leaves_the_disk_copy_and_a_disk_eviction_the_pool_copy() {
        let mut ix = KvIndex::new();
        // Written through: every pool block is on disk too.
        ix.apply("a", 1, &Stored(Pool, vec![1u64, 2, 3]));
        ix.apply("a", 2, &Stored(Disk, vec![1, 2, 3]));
        assert_eq!((ix.blocks_of("a", Pool), ix.blocks_of("a", Disk), ix.distinct_blocks()), (3, 3, 3));
        // The pool evicts 2 and 3: still loadable from disk.
        assert_eq!(ix.apply("a", 3, &Evicted(Pool, vec![2, 3])), Applied::Applied);
        assert_eq!(ix.overlap("a", &[1, 2, 3]), o(1, 2));
        assert_eq!(ix.distinct_blocks(), 3, "a block on disk is still held");
        // The disk tier deletes 1 (still in the pool) and 3 (nowhere now).
        assert_eq!(ix.apply("a", 4, &Evicted(Disk, vec![1, 3])), Applied::Applied);
        assert_eq!(ix.overlap("a", &[1, 2, 3]), o(1, 1));
        assert_eq!((ix.blocks_of("a", Pool), ix.blocks_of("a", Disk), ix.distinct_blocks()), (1, 1, 2));
        assert!(ix.overlaps(&[3]).is_empty(), "3 left both tiers: no holder");
        // Cleared: both tiers go.
        assert_eq!(ix.apply("a", 5, &Cleared), Applied::Applied);
        assert_eq!((ix.overlap("a", &[1, 2]), ix.distinct_blocks()), (o(0, 0), 0));
    }

    #[test]
    fn evictions_and_clears_remove_only_that_worker_s_blocks() {
        let mut ix = KvIndex::new();
        ix.apply("a", 1, &Stored(Pool, vec![1u64, 2, 3]));
        ix.apply("b", 1, &Stored(Pool, vec![1, 2]));
        assert_eq!(ix.apply("a", 2, &Evicted(Pool, vec![2, 9])), Applied::Applied);
        assert_eq!(ix.overlap("a", &[1, 2, 3]), o(1, 0));
        assert_eq!(ix.overlap("b", &[1, 2, 3]), o(2, 0));
        assert_eq!(ix.apply("b", 2, &Cleared), Applied::Applied);
        assert_eq!(ix.overlap("b", &[1]), o(0, 0));
        assert_eq!(ix.last_seq("b"), 2);
        assert_eq!(ix.apply("b", 3, &Stored(Pool, vec![7])), Applied::Applied, "a clear is an ordinary event: numbering goes on");
        assert_eq!((ix.blocks_of("a", Pool), ix.blocks_of("b", Pool), ix.distinct_blocks()), (2, 1, 3));
    }

    #[test]
    fn a_gap_or_a_restart_drops_the_worker_until_a_snapshot() {
        let mut ix = KvIndex::new();
        ix.apply("a", 1, &Stored(Pool, vec![1u64, 2]));
        ix.apply("a", 2, &Stored(Disk, vec![1, 2, 9]));
        assert_eq!(ix.apply("a", 1, &Stored(Pool, vec![1, 2])), Applied::Duplicate);
        // Event 3 lost: 4 is a gap.
        assert_eq!(ix.apply("a", 4, &Stored(Pool, vec![3])), Applied::NeedResync);
        assert!(ix.needs_resync("a"));
        assert_eq!(ix.overlap("a", &[1, 2]), o(0, 0), "a stale worker holds nothing for routing");
        assert_eq!((ix.blocks_of("a", Disk), ix.distinct_blocks()), (0, 0), "its disk tier is dropped too");
        assert_eq!(ix.apply("a", 5, &Stored(Pool, vec![4])), Applied::NeedResync, "still stale until the snapshot");
        // The snapshot replaces both tiers.
        ix.resync("a", 5, [1, 2], [3, 4]);
        assert!(!ix.needs_resync("a"));
        assert_eq!(ix.overlap("a", &[1, 2, 3, 4, 9]), o(2, 2));
        assert_eq!(ix.apply("a", 6, &Evicted(Disk, vec![4])), Applied::Applied);
        assert_eq!(ix.overlap("a", &[1, 2, 3, 4]), o(2, 1));
        // A second snapshot forgets what the first said.
        ix.resync("a", 9, [7], []);
        assert_eq!((ix.overlap("a", &[1]), ix.blocks_of("a", Disk), ix.distinct_blocks()), (o(0, 0), 0, 1));
        // A first event that is not 1 (the router restarted mid-stream of events): resync.
        assert_eq!(ix.apply("fresh", 7, &Stored(Pool, vec![1])), Applied::NeedResync);
        ix.remove_worker("a");
        assert_eq!((ix.overlap("a", &[7]), ix.distinct_blocks()), (o(0, 0), 0));
    }

    /// Against a model: random events on a few workers, both tiers, with gaps, keep `holders`
    /// the exact inverse of the workers' block sets.
    #[test]
    fn the_two_maps_stay_each_other_s_inverse() {
        let mut u = crate::arrivals::uniforms(7);
        let mut ix: KvIndex<u64> = KvIndex::new();
        let mut seqs = [0u64; 3];
        for _ in 0..3000 {
            let w = (u() * 3.0) as usize;
            let name = format!("w{w}");
            let hs: Vec<u64> = (0..1 + (u() * 4.0) as usize).map(|_| (u() * 20.0) as u64).collect();
            let skip = u() < 0.02;
            seqs[w] += if skip { 2 } else { 1 };
            let tier = if u() < 0.5 { Pool } else { Disk };
            let ev = match (u() * 10.0) as u32 {
                0 => Cleared,
                1..=4 => Evicted(tier, hs),
                _ => Stored(tier, hs),
            };
            if ix.apply(&name, seqs[w], &ev) == Applied::NeedResync && u() < 0.5 {
                ix.resync(&name, seqs[w], [1, 2, 3], [3, 4]);
            }
            for (h, ws) in &ix.holders {
                assert!(!ws.is_empty());
                for w in ws {
                    assert!(ix.workers[w].holds(h));
                }
            }
            for (w, held) in &ix.workers {
                for h in held.pool.iter().chain(&held.disk) {
                    assert!(ix.holders[h].contains(w));
                }
                assert!(!held.stale || (held.pool.is_empty() && held.disk.is_empty()));
            }
        }
    }
}
