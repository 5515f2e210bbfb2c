//! `ferry up` as a supervisor: several routers serving the same pools (`--routers N`), and the
//! routers and workers it restarts when they die. Outputs are held against the single-process
//! engine's greedy ids.

mod cluster_support;

use cluster_support::*;
use ferry_proto::v1::{WorkerRole, WorkerState};
use std::time::Duration;

const PROMPT: [u32; 4] = [1, 504, 3575, 28];

fn lists_ready(ws: &[ferry_proto::v1::WorkerInfo], w: &WorkerProc) -> bool {
    ws.iter().any(|l| l.grpc_addr == w.grpc && l.state == WorkerState::Ready as i32)
}

/// `ferry up --routers 2`: every worker registers with both routers; each serves a greedy request
/// with the reference ids; `ferry pool scale` through the second router reaches the one
/// supervisor, and both routers see the new worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_routers_serve_the_same_pools() {
    let model = smollm2();
    let want = reference(&mut engine(&model), &PROMPT, 12);
    let cluster = Cluster::up(&model, 1, 1, &["--routers", "2"]);
    assert_eq!(cluster.routers.len(), 2, "{:?}", cluster.routers);
    assert_ne!(cluster.routers[0].grpc, cluster.routers[1].grpc);
    assert_ne!(cluster.routers[0].http, cluster.routers[1].http);
    for i in 0..2 {
        let ws = cluster.workers_at(i).await.unwrap();
        for w in &cluster.workers {
            assert!(lists_ready(&ws, w), "router {i} lists {}: {ws:?}", w.name);
        }
        let out = run(&mut cluster.client_at(i).await, token_request(&PROMPT, 12)).await.unwrap_or_else(|e| panic!("through router {i}: {e:?}"));
        assert_eq!(out.ids, want, "through router {i}");
    }

    let second = cluster.routers[1].grpc.clone();
    let mut pool = cluster.pool_command();
    let out = tokio::task::spawn_blocking(move || pool.args(["scale", "decode", "2", "--router", &second]).output().unwrap())
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && text.contains("decode pool: 1 -> 2"), "{text}");
    cluster.wait_registered(WorkerRole::Decode, 2, Duration::from_secs(30)).await;
    let added = cluster.live_workers().into_iter().find(|w| w.name == "decode-2").expect("decode-2 announced");
    for i in 0..2 {
        assert!(lists_ready(&cluster.workers_at(i).await.unwrap(), &added), "router {i} lists decode-2");
    }
    cluster.assert_no_leaks().await;
}

/// A prefill and a decode worker killed with SIGKILL are started again (same names, new
/// processes, new ids at the router) and serve the reference output.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_workers_are_restarted_and_serve_again() {
    let model = smollm2();
    let want = reference(&mut engine(&model), &PROMPT, 12);
    let cluster = Cluster::up(&model, 1, 1, &[]);
    let victims = cluster.workers.clone();
    for v in &victims {
        signal(v.pid, libc::SIGKILL);
    }
    let mut restarted = Vec::new();
    for v in &victims {
        let new = cluster.wait_restarted(v, Duration::from_secs(45)).await;
        assert_eq!(new.restarts, 1, "{new:?}");
        assert_ne!(new.grpc, v.grpc, "a new process on a new port");
        restarted.push(new);
    }
    let ws = cluster.workers().await;
    let id_of = |w: &WorkerProc| ws.iter().find(|l| l.grpc_addr == w.grpc && l.state == WorkerState::Ready as i32).map(|l| l.worker_id.clone()).expect("listed");
    let out = run(&mut cluster.client().await, token_request(&PROMPT, 12)).await.expect("a request after the restarts");
    assert_eq!(out.ids, want);
    let new_decode = restarted.iter().find(|w| w.role == "decode").unwrap();
    let new_prefill = restarted.iter().find(|w| w.role == "prefill").unwrap();
    assert_eq!(out.fin.decode_worker, id_of(new_decode));
    assert_eq!(out.fin.prefill_worker, id_of(new_prefill));
    cluster.assert_no_leaks().await;
}

/// A router killed with SIGKILL comes back on the same ports; the workers register with it again
/// and it serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_router_is_restarted_on_its_ports() {
    let model = smollm2();
    let want = reference(&mut engine(&model), &PROMPT, 12);
    let cluster = Cluster::up(&model, 1, 1, &[]);
    let old = cluster.routers[0].clone();
    signal(old.pid, libc::SIGKILL);
    let new = cluster.wait_router_restarted(&old, Duration::from_secs(45)).await;
    assert_eq!((new.grpc.as_str(), new.http.as_str(), new.restarts), (old.grpc.as_str(), old.http.as_str(), 1), "{new:?}");
    let out = run(&mut cluster.client().await, token_request(&PROMPT, 12)).await.expect("a request through the restarted router");
    assert_eq!(out.ids, want);
    // The workers were not restarted: the same processes registered again.
    let live = cluster.live_workers();
    assert!(live.iter().zip(&cluster.workers).all(|(a, b)| a.pid == b.pid), "{live:?}");
    cluster.assert_no_leaks().await;
}

/// One of two routers killed with SIGKILL: requests through the other succeed at once, and the
/// killed one comes back on its ports with both workers listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_of_two_routers_killed_the_other_serves_at_once() {
    let model = smollm2();
    let want = reference(&mut engine(&model), &PROMPT, 12);
    let cluster = Cluster::up(&model, 1, 1, &["--routers", "2"]);
    let victim = cluster.routers[0].clone();
    let mut other = cluster.client_at(1).await;
    signal(victim.pid, libc::SIGKILL);
    let out = run(&mut other, token_request(&PROMPT, 12)).await.expect("a request through the surviving router");
    assert_eq!(out.ids, want);
    let back = cluster.wait_router_restarted(&victim, Duration::from_secs(45)).await;
    assert_eq!((back.grpc.as_str(), back.restarts), (victim.grpc.as_str(), 1), "{back:?}");
    let out = run(&mut cluster.client_at(0).await, token_request(&PROMPT, 12)).await.expect("a request through the restarted router");
    assert_eq!(out.ids, want);
    cluster.assert_no_leaks().await;
}
