//! The KV disk tier across processes (issue 38): a worker killed with SIGKILL and restarted by
//! `ferry up` on the same `--kv-disk` subfolder finds its blocks again, announces them, and serves
//! the next turn of a conversation from disk (cached tokens above 0 right after the restart) with
//! the reference output; a restarted router rebuilds its index of the disk tier from the workers.

mod cluster_support;

use cluster_support::*;
use std::time::{Duration, Instant};

/// The router's indexed blocks of `tier`, summed over workers.
fn indexed(metrics: &str, tier: &str) -> f64 {
    let key = format!("tier=\"{tier}\"");
    metrics
        .lines()
        .filter(|l| l.starts_with("ferry_router_kv_indexed_blocks{") && l.contains(&key))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum()
}

/// Waits until the router's index holds at least `n` disk blocks (heartbeats carry them).
async fn wait_indexed_disk(cluster: &Cluster, n: f64, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        // The router's current process (a restarted one has a new metrics port).
        let addr = cluster.live_routers()[0].metrics.clone();
        let m = http_get(&addr, "/metrics").await.unwrap_or_default();
        if indexed(&m, "disk") >= n {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: the router indexed {} disk blocks, {n} wanted", indexed(&m, "disk"));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_workers_serve_their_prefixes_from_disk_after_the_restart() {
    let model = smollm2();
    let mut reference_engine = engine(&model);
    // A first turn of 160 tokens (10 blocks of 16), then the next turn repeating it and its answer.
    let first: Vec<u32> = (0..160u32).map(|i| 300 + (i * 37) % 4000).collect();
    let answer = reference(&mut reference_engine, &first, 8);
    let mut second = [first.clone(), answer.clone()].concat();
    second.extend((0..20u32).map(|i| 900 + i * 11));
    let want = reference(&mut reference_engine, &second, 8);
    drop(reference_engine);

    let dir = std::env::temp_dir().join(format!("ferry-test-kv-disk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let dir_s = dir.display().to_string();
    let cluster = Cluster::up(&model, 1, 1, &["--kv-disk", &dir_s, "--kv-disk-bytes", "256MiB"]);
    let out = run(&mut cluster.client().await, token_request(&first, 8)).await.expect("the first turn");
    assert_eq!(out.ids, answer);
    // Every worker wrote its blocks under its own subfolder, and the router heard of them.
    for w in &cluster.workers {
        let blocks = dir.join(&w.name).join("blocks");
        assert!(blocks.is_dir(), "{} has no {}", w.name, blocks.display());
    }
    wait_indexed_disk(&cluster, 10.0, "before the restart").await;

    for w in cluster.workers.clone() {
        signal(w.pid, libc::SIGKILL);
        cluster.wait_restarted(&w, Duration::from_secs(60)).await;
    }
    // The restarted workers announce what they found on disk; the pools are empty.
    wait_indexed_disk(&cluster, 10.0, "after the workers' restart").await;
    let out = run(&mut cluster.client().await, token_request(&second, 8)).await.expect("the second turn");
    assert_eq!(out.ids, want, "the same output from disk");
    assert!(out.fin.cached_tokens >= 160, "served from disk right after the restart: {} cached tokens", out.fin.cached_tokens);

    // A restarted router rebuilds its index from the workers, the disk tier included.
    let old = cluster.routers[0].clone();
    signal(old.pid, libc::SIGKILL);
    cluster.wait_router_restarted(&old, Duration::from_secs(60)).await;
    wait_indexed_disk(&cluster, 10.0, "after the router's restart").await;
    cluster.assert_no_leaks().await;
    drop(cluster);
    let _ = std::fs::remove_dir_all(&dir);
}
