//! A worker's log of prefix cache events, for the routers' indexes of which worker holds which
//! KV blocks (issue 17: KV-aware routing; Dynamo's KV router is fed the same way, by its engines'
//! block-stored / block-evicted events).
//!
//! The engine thread drains [`Engine::drain_cache_events`] at every publish and pushes them here
//! ([`publish`]); the log numbers them from 1 for the life of the process (runs of one kind from
//! one drain become one event), keeps a mirror of the hashes the cache holds now (for snapshots),
//! and a bounded window of recent events. Each router link ([`crate::cluster::registration`]) keeps its
//! own [`Cursor`]: the last event that router acknowledged (the last heartbeat it answered). A
//! heartbeat carries the events after the cursor, at most [`LogConfig::batch_hashes`] hashes;
//! one that failed is sent again with the same events (the router ignores numbers it has). A
//! snapshot (every hash held, current as of the newest event) goes instead after a
//! registration, when the router answers `kv_resync`, or when the cursor fell out of the window.
//!
//! With a disk tier (`--kv-disk`, issue 38), the blocks the engine writes to or deletes from disk
//! ([`ferry_core::DiskEvent`], pushed with [`EventLog::push_disk`]) are logged in the same
//! numbering, each event tagged with its [`KvTier`] (a run never mixes tiers), with their own
//! mirror of what is held; a snapshot carries both sets.
//!
//! The decision of what to send is the pure [`EventLog::outgoing`]; [`CacheLog`] puts the log
//! behind a mutex, because two kinds of owner touch it (the engine thread pushes, every router's
//! heartbeat task reads), each for a moment, and an actor would only add a thread.

use ferry_core::{CacheEvent, CacheEventKind, DiskEvent, KvTier};
use ferry_proto::v1::{KvCacheEvent, KvCacheEvents};
use std::collections::{HashSet, VecDeque};
use std::sync::{Mutex, MutexGuard};

/// Bounds of the log, in block hashes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogConfig {
    /// Hashes kept in the window of recent events; a router further behind gets a snapshot.
    pub window_hashes: usize,
    /// Most hashes sent in one heartbeat (at least one event goes, whatever its size).
    pub batch_hashes: usize,
    /// Most hashes in one event (a long run of stores from one step is split).
    pub event_hashes: usize,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig { window_hashes: 1 << 16, batch_hashes: 1 << 13, event_hashes: 256 }
    }
}

/// One logged event: `hashes` entered the cache's `tier` (`stored`) or left it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Logged {
    pub seq: u64,
    pub tier: KvTier,
    pub stored: bool,
    pub hashes: Vec<u64>,
}

/// One router's position in the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cursor {
    /// The last event the router acknowledged (0: none).
    pub acked: u64,
    /// The router must get a snapshot next.
    pub snapshot: bool,
}

impl Cursor {
    /// Just registered: the router starts clean, so it gets a snapshot first.
    pub fn registered() -> Cursor {
        Cursor { acked: 0, snapshot: true }
    }

    /// The heartbeat that carried events up to `upto` ([`Outgoing::upto`]) was answered;
    /// `resync`: the router asked for a snapshot.
    pub fn acknowledged(&mut self, upto: u64, resync: bool) {
        self.acked = upto;
        self.snapshot = resync;
    }
}

/// What one heartbeat carries, and the event it brings the router up to.
#[derive(Clone, Debug, PartialEq)]
pub struct Outgoing {
    pub events: KvCacheEvents,
    pub upto: u64,
}

/// The log: pure data.
#[derive(Debug, Default)]
pub struct EventLog {
    cfg: LogConfig,
    /// What the pool holds, as the events tell.
    held: HashSet<u64>,
    /// What the disk tier holds, as the events tell.
    held_disk: HashSet<u64>,
    recent: VecDeque<Logged>,
    recent_hashes: usize,
    last_seq: u64,
    /// The engine's next event number (to notice events its own bounded log dropped).
    engine_next: Option<u64>,
    /// Engine events that never reached this log (the engine's log overflowed between drains).
    pub lost: u64,
}

impl EventLog {
    pub fn new(cfg: LogConfig) -> EventLog {
        EventLog { cfg, ..Default::default() }
    }

    /// The number of the newest event (0: none yet).
    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    /// Hashes the cache holds now, as the events tell.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// Whether the cache holds `hash`, as the events tell.
    pub fn holds(&self, hash: u64) -> bool {
        self.held.contains(&hash)
    }

    /// Hashes the disk tier holds now, as the events tell.
    pub fn held_disk(&self) -> usize {
        self.held_disk.len()
    }

    /// Whether the disk tier holds `hash`, as the events tell.
    pub fn holds_disk(&self, hash: u64) -> bool {
        self.held_disk.contains(&hash)
    }

    /// Add events drained from the engine (oldest first), numbering them on from the last.
    pub fn push(&mut self, events: &[CacheEvent]) {
        let before = self.last_seq;
        for e in events {
            if let Some(next) = self.engine_next
                && e.seq != next
            {
                self.lost += e.seq.saturating_sub(next);
            }
            self.engine_next = Some(e.seq + 1);
            let (stored, hash) = match e.kind {
                CacheEventKind::Stored { hash, .. } => (true, hash.0),
                CacheEventKind::Evicted { hash, .. } => (false, hash.0),
            };
            if stored {
                self.held.insert(hash);
            } else {
                self.held.remove(&hash);
            }
            self.append(before, KvTier::Pool, stored, hash);
        }
        self.trim();
    }

    /// Add disk tier events drained from the engine (oldest first), numbering them on from the
    /// last, in runs of their own (never in a pool event).
    pub fn push_disk(&mut self, events: &[DiskEvent]) {
        let before = self.last_seq;
        for e in events {
            let hash = e.hash.0;
            if e.stored {
                self.held_disk.insert(hash);
            } else {
                self.held_disk.remove(&hash);
            }
            self.append(before, KvTier::Disk, e.stored, hash);
        }
        self.trim();
    }

    /// Add `hash` to the newest event if this push made it (numbered after `before`: an event
    /// that may have been sent never changes), it is of the same tier and kind and has room.
    fn append(&mut self, before: u64, tier: KvTier, stored: bool, hash: u64) {
        let max = self.cfg.event_hashes.max(1);
        match self.recent.back_mut() {
            Some(last) if last.seq > before && last.tier == tier && last.stored == stored && last.hashes.len() < max => last.hashes.push(hash),
            _ => {
                self.last_seq += 1;
                self.recent.push_back(Logged { seq: self.last_seq, tier, stored, hashes: vec![hash] });
            }
        }
        self.recent_hashes += 1;
    }

    fn trim(&mut self) {
        while self.recent_hashes > self.cfg.window_hashes {
            let Some(old) = self.recent.pop_front() else { break };
            self.recent_hashes -= old.hashes.len();
        }
    }

    /// What a router at `cursor` gets next.
    pub fn outgoing(&self, cursor: &Cursor) -> Outgoing {
        let first_kept = self.recent.front().map_or(self.last_seq + 1, |e| e.seq);
        let fell_out = cursor.acked + 1 < first_kept;
        if cursor.snapshot || fell_out || cursor.acked > self.last_seq {
            let sorted = |set: &HashSet<u64>| {
                let mut hashes: Vec<u64> = set.iter().copied().collect();
                hashes.sort_unstable();
                hashes
            };
            let events = KvCacheEvents {
                snapshot: true,
                snapshot_seq: self.last_seq,
                snapshot_hashes: sorted(&self.held),
                snapshot_disk_hashes: sorted(&self.held_disk),
                ..Default::default()
            };
            return Outgoing { events, upto: self.last_seq };
        }
        let mut events = Vec::new();
        let mut upto = cursor.acked;
        let mut budget = self.cfg.batch_hashes;
        for e in self.recent.iter().filter(|e| e.seq > cursor.acked) {
            if !events.is_empty() && e.hashes.len() > budget {
                break;
            }
            budget = budget.saturating_sub(e.hashes.len());
            upto = e.seq;
            events.push(KvCacheEvent { seq: e.seq, stored: e.stored, hashes: e.hashes.clone(), tier: ferry_proto::kv_tier_to_wire(e.tier) as i32 });
        }
        Outgoing { events: KvCacheEvents { events, ..Default::default() }, upto }
    }
}

/// The log shared by the engine thread and the heartbeat tasks (see the module doc).
#[derive(Debug, Default)]
pub struct CacheLog(Mutex<EventLog>);

impl CacheLog {
    pub fn new(cfg: LogConfig) -> CacheLog {
        CacheLog(Mutex::new(EventLog::new(cfg)))
    }

    /// The log, for a moment (a panic elsewhere leaves it usable: every change is whole).
    pub fn lock(&self) -> MutexGuard<'_, EventLog> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn push(&self, events: &[CacheEvent]) {
        if !events.is_empty() {
            self.lock().push(events);
        }
    }

    /// Disk tier events from the engine (`Engine::drain_disk_events`).
    pub fn push_disk(&self, events: &[DiskEvent]) {
        if !events.is_empty() {
            self.lock().push_disk(events);
        }
    }

    pub fn outgoing(&self, cursor: &Cursor) -> Outgoing {
        self.lock().outgoing(cursor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::BlockHash;
    use ferry_proto::v1;

    /// Engine events numbered from `first`: positive ids stored, negative evicted.
    fn engine_events(first: u64, hs: &[i64]) -> Vec<CacheEvent> {
        hs.iter()
            .enumerate()
            .map(|(i, &h)| {
                let (hash, block) = (BlockHash(h.unsigned_abs()), 0);
                let kind = if h > 0 { CacheEventKind::Stored { hash, parent: None, block } } else { CacheEventKind::Evicted { hash, block } };
                CacheEvent { seq: first + i as u64, kind }
            })
            .collect()
    }

    fn small() -> LogConfig {
        LogConfig { window_hashes: 8, batch_hashes: 3, event_hashes: 2 }
    }

    fn seqs(o: &Outgoing) -> Vec<(u64, bool, Vec<u64>)> {
        o.events.events.iter().map(|e| (e.seq, e.stored, e.hashes.clone())).collect()
    }

    #[test]
    fn events_are_renumbered_from_one_and_grouped_within_a_push() {
        let mut log = EventLog::new(small());
        // The engine numbers from 0; runs of one kind group, two hashes at most per event.
        log.push(&engine_events(0, &[1, 2, 3, -1]));
        log.push(&engine_events(4, &[-2, 4]));
        assert_eq!(log.last_seq(), 5);
        let o = log.outgoing(&Cursor { acked: 0, snapshot: false });
        assert_eq!(seqs(&o), vec![(1, true, vec![1, 2]), (2, true, vec![3])], "at most 3 hashes per heartbeat");
        assert_eq!(o.upto, 2);
        let o = log.outgoing(&Cursor { acked: 2, snapshot: false });
        // The second push does not extend the first push's eviction (it may have been sent).
        assert_eq!(seqs(&o), vec![(3, false, vec![1]), (4, false, vec![2]), (5, true, vec![4])]);
        assert_eq!((o.upto, log.lost), (5, 0));
        // Up to date: nothing to send, the cursor stays.
        let o = log.outgoing(&Cursor { acked: 5, snapshot: false });
        assert!(o.events.events.is_empty() && !o.events.snapshot);
        assert_eq!(o.upto, 5);
    }

    #[test]
    fn a_cursor_advances_only_when_the_heartbeat_is_answered() {
        let mut log = EventLog::new(LogConfig::default());
        let mut c = Cursor::registered();
        // Registered: a snapshot first (empty, as of event 0).
        let o = log.outgoing(&c);
        assert!(o.events.snapshot && o.events.snapshot_hashes.is_empty());
        assert_eq!((o.events.snapshot_seq, o.upto), (0, 0));
        c.acknowledged(o.upto, false);
        log.push(&engine_events(0, &[7, 8]));
        let o = log.outgoing(&c);
        assert_eq!(seqs(&o), vec![(1, true, vec![7, 8])]);
        // The heartbeat failed: the next one carries the same events, and the new ones.
        log.push(&engine_events(2, &[-7]));
        let again = log.outgoing(&c);
        assert_eq!(seqs(&again), vec![(1, true, vec![7, 8]), (2, false, vec![7])]);
        c.acknowledged(again.upto, false);
        assert_eq!(c, Cursor { acked: 2, snapshot: false });
        // The router answers kv_resync: a snapshot next, of what is held now.
        c.acknowledged(log.outgoing(&c).upto, true);
        let o = log.outgoing(&c);
        assert!(o.events.snapshot);
        assert_eq!((o.events.snapshot_seq, o.events.snapshot_hashes.clone(), o.upto), (2, vec![8], 2));
        c.acknowledged(o.upto, false);
        assert!(log.outgoing(&c).events.events.is_empty());
    }

    #[test]
    fn a_cursor_that_fell_out_of_the_window_gets_a_snapshot() {
        let mut log = EventLog::new(small());
        log.push(&engine_events(0, &[1, 2, 3, 4, 5, 6]));
        let behind = Cursor { acked: 1, snapshot: false };
        assert_eq!(seqs(&log.outgoing(&behind))[0].0, 2, "still in the window");
        log.push(&engine_events(6, &[-1, -2, 9, 10]));
        // 10 hashes logged, 8 kept: event 1 ({1, 2}) is gone, so a router at 0 cannot catch up.
        let o = log.outgoing(&Cursor { acked: 0, snapshot: false });
        assert!(o.events.snapshot, "{o:?}");
        assert_eq!((o.events.snapshot_hashes.clone(), o.events.snapshot_seq, o.upto), (vec![3, 4, 5, 6, 9, 10], 5, 5));
        // A router at 1 still can (event 2 is the oldest kept).
        assert!(!log.outgoing(&behind).events.snapshot);
        // A cursor ahead of the log (it cannot be: a bug) resyncs rather than waits.
        assert!(log.outgoing(&Cursor { acked: 99, snapshot: false }).events.snapshot);
    }

    #[test]
    fn the_snapshot_follows_evictions_and_notes_lost_engine_events() {
        let mut log = EventLog::new(LogConfig::default());
        log.push(&engine_events(0, &[1, 2, 3]));
        log.push(&engine_events(3, &[-2, 4, -1, 2]));
        assert!(log.holds(2) && !log.holds(1));
        let o = log.outgoing(&Cursor::registered());
        assert_eq!(o.events.snapshot_hashes, vec![2, 3, 4]);
        // The engine's next drain starts at 9, not 7: two events never came.
        log.push(&engine_events(9, &[5]));
        assert_eq!((log.lost, log.held()), (2, 4));
    }

    /// Disk events: positive ids written, negative deleted.
    fn disk_events(hs: &[i64]) -> Vec<DiskEvent> {
        hs.iter().map(|&h| DiskEvent { stored: h > 0, hash: BlockHash(h.unsigned_abs()) }).collect()
    }

    fn tiers(o: &Outgoing) -> Vec<(u64, v1::KvTier, bool, Vec<u64>)> {
        o.events.events.iter().map(|e| (e.seq, e.tier(), e.stored, e.hashes.clone())).collect()
    }

    #[test]
    fn disk_events_share_the_numbering_but_never_a_pool_event() {
        use v1::KvTier::{Disk, Pool};
        let mut log = EventLog::new(LogConfig { window_hashes: 100, batch_hashes: 100, event_hashes: 3 });
        log.push(&engine_events(0, &[1, 2]));
        // Written through: the same blocks reach the disk tier, in events of their own.
        log.push_disk(&disk_events(&[1, 2, 3, 4]));
        // Each push starts its own events (an event that may have been sent never changes).
        log.push(&engine_events(2, &[-1, 5]));
        log.push_disk(&disk_events(&[-3]));
        assert_eq!(log.last_seq(), 6);
        let o = log.outgoing(&Cursor { acked: 0, snapshot: false });
        assert_eq!(
            tiers(&o),
            vec![
                (1, Pool, true, vec![1, 2]),
                (2, Disk, true, vec![1, 2, 3]),
                (3, Disk, true, vec![4]),
                (4, Pool, false, vec![1]),
                (5, Pool, true, vec![5]),
                (6, Disk, false, vec![3]),
            ]
        );
        assert_eq!(o.upto, 6);
        // A pool eviction leaves the disk copy: 1 is on disk only, 3 left the disk.
        assert!(!log.holds(1) && log.holds_disk(1) && !log.holds_disk(3));
        assert_eq!((log.held(), log.held_disk()), (2, 3));
        // The snapshot carries both tiers, as of the newest event.
        let s = log.outgoing(&Cursor::registered());
        assert!(s.events.snapshot);
        assert_eq!((s.events.snapshot_hashes.clone(), s.events.snapshot_disk_hashes.clone(), s.events.snapshot_seq), (vec![2, 5], vec![1, 2, 4], 6));
        // Without a disk tier nothing changes on the wire: pool events, an empty disk set.
        let mut plain = EventLog::new(LogConfig::default());
        plain.push(&engine_events(0, &[9]));
        assert_eq!(tiers(&plain.outgoing(&Cursor { acked: 0, snapshot: false })), vec![(1, Pool, true, vec![9])]);
        assert!(plain.outgoing(&Cursor::registered()).events.snapshot_disk_hashes.is_empty());
    }

    #[test]
    fn disk_events_count_against_the_window() {
        let mut log = EventLog::new(small());
        log.push_disk(&disk_events(&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]));
        // 10 hashes logged, 8 kept: a router at 0 gets a snapshot of the disk tier.
        let o = log.outgoing(&Cursor { acked: 0, snapshot: false });
        assert!(o.events.snapshot && o.events.snapshot_hashes.is_empty());
        assert_eq!(o.events.snapshot_disk_hashes, (1..=10).collect::<Vec<u64>>());
    }

    #[test]
    fn a_single_event_larger_than_the_batch_still_goes() {
        let mut log = EventLog::new(LogConfig { window_hashes: 100, batch_hashes: 2, event_hashes: 5 });
        log.push(&engine_events(0, &[1, 2, 3, 4, 5]));
        let o = log.outgoing(&Cursor { acked: 0, snapshot: false });
        assert_eq!(seqs(&o), vec![(1, true, vec![1, 2, 3, 4, 5])]);
    }
}
