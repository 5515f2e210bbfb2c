//! The registry's index through its own API: heartbeats carry events, gaps ask for a snapshot,
//! workers that go leave the index, registrations start clean.

use std::time::{Duration, Instant};

use ferry_core::kv_index::Overlap;
use ferry_core::{KvDtype, KvTier, WorkerState};
use ferry_proto::v1;

use crate::workers::dial::DialOptions;
use crate::workers::registry::Registry;

fn registry() -> Registry {
    Registry::new(Duration::from_secs(3), Duration::from_secs(1), DialOptions { connect_timeout: Duration::from_secs(1), tls: None, cluster: Default::default() })
}

fn register(r: &Registry, role: v1::WorkerRole, addr: &str) -> String {
    let req = v1::RegisterRequest { role: role as i32, grpc_addr: addr.into(), fingerprint: "fp".into(), prefix_cache: true, ..Default::default() };
    r.register(&req).expect("register").worker_id
}

/// Events numbered from `first`, one per group; positive hashes stored, negative evicted.
fn events(first: u64, groups: &[&[i64]]) -> v1::KvCacheEvents {
    let events = groups
        .iter()
        .enumerate()
        .map(|(i, g)| v1::KvCacheEvent { seq: first + i as u64, stored: g[0] > 0, hashes: g.iter().map(|h| h.unsigned_abs()).collect(), ..Default::default() })
        .collect();
    v1::KvCacheEvents { events, ..Default::default() }
}

/// [`events`] of the disk tier.
fn disk_events(first: u64, groups: &[&[i64]]) -> v1::KvCacheEvents {
    let mut e = events(first, groups);
    for e in &mut e.events {
        e.tier = v1::KvTier::Disk as i32;
    }
    e
}

fn snapshot(seq: u64, hashes: &[u64]) -> v1::KvCacheEvents {
    v1::KvCacheEvents { snapshot: true, snapshot_seq: seq, snapshot_hashes: hashes.to_vec(), ..Default::default() }
}

/// One heartbeat from `id` (at `addr`) carrying `kv`; returns whether the answer asks a resync.
fn beat(r: &Registry, id: &str, addr: &str, kv: Option<v1::KvCacheEvents>) -> bool {
    let req = v1::HeartbeatRequest { worker_id: id.into(), grpc_addr: addr.into(), kv_events: kv, ..Default::default() };
    let b = r.heartbeat(&req, Instant::now()).expect("heartbeat");
    assert_eq!(b.state, WorkerState::Ready);
    b.kv_resync
}

#[tokio::test]
async fn heartbeat_events_fill_the_index() {
    let r = registry();
    let p = register(&r, v1::WorkerRole::Prefill, "127.0.0.1:1");
    let d = register(&r, v1::WorkerRole::Decode, "127.0.0.1:2");
    assert!(!beat(&r, &p, "127.0.0.1:1", Some(snapshot(0, &[]))));
    assert!(!beat(&r, &p, "127.0.0.1:1", Some(events(1, &[&[10, 11, 12], &[13]]))));
    assert!(!beat(&r, &d, "127.0.0.1:2", Some(events(1, &[&[10, 11], &[-11], &[20]]))));
    assert_eq!(r.prefix_held(&p, &f32_chain(&[10, 11, 12, 13, 14]), usize::MAX).total(), 4);
    assert_eq!(r.prefix_held(&d, &f32_chain(&[10, 11, 12]), usize::MAX).total(), 1);
    assert_eq!(r.prefix_held("nobody", &f32_chain(&[10]), usize::MAX).total(), 0);
    let o = r.prefix_overlaps(&[10, 11, 12]);
    assert_eq!((o[&p], o[&d], o.len()), (3, 1, 2));
    assert!(r.prefix_overlaps(&[99]).is_empty());
    assert_eq!((r.prefix_blocks(&p), r.prefix_blocks(&d)), (4, 2));
    // A heartbeat sent again (its answer was lost) changes nothing; one without events neither.
    assert!(!beat(&r, &d, "127.0.0.1:2", Some(events(1, &[&[10, 11], &[-11], &[20]]))));
    assert!(!beat(&r, &d, "127.0.0.1:2", None));
    assert_eq!(r.prefix_held(&d, &f32_chain(&[10, 11]), usize::MAX).total(), 1);
}

/// Disk tier events and snapshots: the overlap runs over both tiers, split by tier; a decode
/// worker's disk blocks count as held (it loads them on attach); an unknown tier is numbered but
/// changes nothing.
#[tokio::test]
async fn the_index_keeps_each_worker_s_disk_tier() {
    let r = registry();
    let p = register(&r, v1::WorkerRole::Prefill, "127.0.0.1:1");
    let o = |pool, disk| Overlap { pool, disk };
    assert!(!beat(&r, &p, "127.0.0.1:1", Some(events(1, &[&[1, 2]]))));
    // Written through to disk, then the pool evicts 2: block 2 is on disk only.
    let mut e = disk_events(2, &[&[1, 2, 3]]);
    e.events.extend(events(3, &[&[-2]]).events);
    assert!(!beat(&r, &p, "127.0.0.1:1", Some(e)));
    assert_eq!(r.prefix_held(&p, &f32_chain(&[1, 2, 3, 4]), usize::MAX), o(1, 2));
    assert_eq!(r.prefix_held(&p, &f32_chain(&[1, 2, 3]), 2), o(1, 1), "at most max_blocks");
    assert_eq!((r.prefix_blocks_in(&p, KvTier::Pool), r.prefix_blocks_in(&p, KvTier::Disk)), (1, 3));
    assert_eq!(r.prefix_overlaps(&[1, 2, 3])[&p], 3, "overlaps count both tiers");
    // The disk tier deletes 3.
    assert!(!beat(&r, &p, "127.0.0.1:1", Some(disk_events(4, &[&[-3]]))));
    assert_eq!(r.prefix_held(&p, &f32_chain(&[1, 2, 3]), usize::MAX), o(1, 1));
    // A tier from a newer worker: numbered (no gap after it), about nothing.
    let mut odd = events(5, &[&[9]]);
    odd.events[0].tier = 7;
    assert!(!beat(&r, &p, "127.0.0.1:1", Some(odd)));
    assert!(!beat(&r, &p, "127.0.0.1:1", Some(events(6, &[&[8]]))));
    assert_eq!(r.prefix_held(&p, &f32_chain(&[9]), usize::MAX), o(0, 0));
    // A snapshot replaces both tiers.
    let mut s = snapshot(6, &[5]);
    s.snapshot_disk_hashes = vec![5, 6, 7];
    assert!(!beat(&r, &p, "127.0.0.1:1", Some(s)));
    assert_eq!(r.prefix_held(&p, &f32_chain(&[5, 6, 7, 1]), usize::MAX), o(1, 2));
    assert_eq!((r.prefix_blocks_in(&p, KvTier::Pool), r.prefix_blocks_in(&p, KvTier::Disk)), (1, 3));
}

#[tokio::test]
async fn a_gap_asks_for_a_snapshot_and_the_snapshot_restores() {
    let r = registry();
    let p = register(&r, v1::WorkerRole::Prefill, "127.0.0.1:1");
    assert!(!beat(&r, &p, "127.0.0.1:1", Some(events(1, &[&[1, 2]]))));
    // Event 2 never arrived.
    assert!(beat(&r, &p, "127.0.0.1:1", Some(events(3, &[&[3]]))), "a gap asks for a snapshot");
    assert_eq!(r.prefix_held(&p, &f32_chain(&[1, 2]), usize::MAX).total(), 0, "an untrusted worker holds nothing");
    // Until the snapshot comes, every answer asks again (the first answer may have been lost).
    assert!(beat(&r, &p, "127.0.0.1:1", Some(events(4, &[&[4]]))));
    assert!(beat(&r, &p, "127.0.0.1:1", None));
    // The snapshot (as of event 4), with events after it in the same heartbeat.
    let mut s = snapshot(4, &[1, 2, 3, 4]);
    s.events = events(4, &[&[4], &[-4], &[5]]).events;
    assert!(!beat(&r, &p, "127.0.0.1:1", Some(s)));
    assert_eq!(r.prefix_held(&p, &f32_chain(&[1, 2, 3, 4]), usize::MAX).total(), 3);
    assert_eq!(r.prefix_held(&p, &f32_chain(&[1, 2, 3, 5]), usize::MAX).total(), 4);
    assert!(!beat(&r, &p, "127.0.0.1:1", Some(events(7, &[&[6]]))));
    assert_eq!(r.prefix_blocks(&p), 5);
}

#[tokio::test]
async fn workers_that_go_leave_the_index() {
    let r = registry();
    let addrs = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:4"];
    let ids: Vec<String> = addrs.iter().map(|a| register(&r, v1::WorkerRole::Prefill, a)).collect();
    for (id, a) in ids.iter().zip(addrs) {
        assert!(!beat(&r, id, a, Some(events(1, &[&[7, 8]]))));
    }
    assert_eq!(r.prefix_overlaps(&[7, 8]).len(), 4);
    r.mark_dead(&ids[0], "test");
    r.deregister(&ids[1], addrs[1]);
    r.remove(&ids[2]).expect("remove");
    let o = r.prefix_overlaps(&[7, 8]);
    assert_eq!(o.keys().collect::<Vec<_>>(), vec![&ids[3]]);
    // The lease runs out for the last one.
    r.sweep(Instant::now() + Duration::from_secs(10));
    assert!(r.prefix_overlaps(&[7]).is_empty());
    assert_eq!(r.prefix_held(&ids[3], &f32_chain(&[7]), usize::MAX).total(), 0);
}

#[tokio::test]
async fn a_registration_starts_clean_and_a_snapshot_fills_it() {
    let r = registry();
    let addr = "127.0.0.1:1";
    let first = register(&r, v1::WorkerRole::Prefill, addr);
    assert!(!beat(&r, &first, addr, Some(events(1, &[&[1, 2, 3]]))));
    // The worker is marked dead; its next heartbeat is refused, it registers again (new id).
    r.mark_dead(&first, "test");
    let req = v1::HeartbeatRequest { worker_id: first.clone(), grpc_addr: addr.into(), ..Default::default() };
    assert!(r.heartbeat(&req, Instant::now()).is_err());
    let again = register(&r, v1::WorkerRole::Prefill, addr);
    assert_ne!(first, again);
    assert_eq!(r.prefix_held(&again, &f32_chain(&[1]), usize::MAX).total(), 0, "nothing carried over");
    // Events mid-stream (say the worker missed the registration's snapshot): resync.
    assert!(beat(&r, &again, addr, Some(events(2, &[&[4]]))));
    assert!(!beat(&r, &again, addr, Some(snapshot(2, &[1, 2, 3, 4]))));
    assert_eq!(r.prefix_held(&again, &f32_chain(&[1, 2, 3, 4]), usize::MAX).total(), 4);

    // A restarted router (a fresh registry) hears a worker mid-stream: it asks for a snapshot.
    let restarted = registry();
    let id = register(&restarted, v1::WorkerRole::Prefill, addr);
    assert!(beat(&restarted, &id, addr, Some(events(9, &[&[5]]))));
    assert!(!beat(&restarted, &id, addr, Some(snapshot(9, &[1, 5]))));
    assert_eq!(restarted.prefix_held(&id, &f32_chain(&[1, 5]), usize::MAX).total(), 2);
}

#[tokio::test]
async fn the_chain_is_the_workers_chain() {
    let r = registry();
    assert!(r.prefix_chain(b"", &[1, 2, 3, 4], 2).is_empty(), "no fingerprint before a registration");
    register(&r, v1::WorkerRole::Prefill, "127.0.0.1:1");
    let tokens: Vec<u32> = (0..37).collect();
    let root = ferry_core::BlockHash::root(b"fp", b"tenant");
    let want: Vec<u64> = ferry_core::prefix_cache::block_hashes(root, &tokens, 16).into_iter().map(|h| h.0).collect();
    assert_eq!(want.len(), 2);
    assert_eq!(r.prefix_chain(b"tenant", &tokens, 16).of(KvDtype::F32), want);
    assert_ne!(r.prefix_chain(b"", &tokens, 16).of(KvDtype::F32), want, "the salt separates chains");
    assert!(r.prefix_chain(b"", &tokens, 0).is_empty());
}

/// An int8 worker hashes the same prompt under another root, and the router asks each worker
/// with the chain of its own dtype; an unknown dtype name is refused at registration.
#[tokio::test]
async fn each_worker_is_asked_with_the_chain_of_its_kv_dtype() {
    let r = registry();
    let f = register(&r, v1::WorkerRole::Decode, "127.0.0.1:1");
    let req = v1::RegisterRequest { role: v1::WorkerRole::Decode as i32, grpc_addr: "127.0.0.1:2".into(), fingerprint: "fp".into(), prefix_cache: true, kv_dtype: "int8-hadamard".into(), ..Default::default() };
    let i = r.register(&req).expect("register").worker_id;
    let tokens: Vec<u32> = (0..32).collect();
    let chains = r.prefix_chain(b"", &tokens, 16);
    let (cf, ci) = (chains.of(KvDtype::F32).to_vec(), chains.of(KvDtype::Int8).to_vec());
    assert_eq!((cf.len(), ci.len()), (2, 2));
    assert_ne!(cf, ci, "the dtype is part of a block's hash");
    let root = ferry_core::BlockHash::cache_root(b"fp", KvDtype::Int8, b"");
    assert_eq!(ci, ferry_core::prefix_cache::block_hashes(root, &tokens, 16).into_iter().map(|h| h.0).collect::<Vec<_>>());
    assert!(!beat(&r, &f, "127.0.0.1:1", Some(snapshot(0, &cf))));
    assert!(!beat(&r, &i, "127.0.0.1:2", Some(snapshot(0, &ci))));
    assert_eq!((r.prefix_held(&f, &chains, usize::MAX).total(), r.prefix_held(&i, &chains, usize::MAX).total()), (2, 2));
    assert_eq!(r.prefix_held(&i, &chains, 1).total(), 1, "at most max_blocks");
    assert_eq!(r.prefix_held(&i, &f32_chain(&cf), usize::MAX).total(), 0, "an int8 worker holds no f32 block");
    let bad = v1::RegisterRequest { kv_dtype: "fp4".into(), grpc_addr: "127.0.0.1:3".into(), ..req };
    let e = r.register(&bad).unwrap_err().to_string();
    assert!(e.contains("kv_dtype") && e.contains("fp4"), "{e}");
    // A worker of the int8 layout before the Hadamard turn: its KV cannot be read, so it is
    // refused at registration, not paired.
    let old = v1::RegisterRequest { kv_dtype: "int8".into(), grpc_addr: "127.0.0.1:4".into(), ..bad };
    let e = r.register(&old).unwrap_err().to_string();
    assert!(e.contains("kv_dtype") && e.contains("Hadamard"), "{e}");
}

fn f32_chain(chain: &[u64]) -> crate::workers::load::PrefixChains {
    crate::workers::load::PrefixChains::single(KvDtype::F32, chain.to_vec())
}
