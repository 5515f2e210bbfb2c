//! The attacks of issue 32, run against one `ferry up` cluster with API keys (and its own cluster
//! secret and admin token), from this process as another local user of the machine would: each is
//! refused with a clear error, every process stays up, and a normal request is served afterwards
//! with no KV block leaked. Loopback only; one cluster for the whole suite, so it stays bounded.

mod cluster_support;

use cluster_support::*;
use ferry_proto::v1;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;

const KEY: &str = "client-key-for-the-security-suite";

fn with_bearer<T>(msg: T, token: Option<&str>) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    if let Some(t) = token {
        r.metadata_mut().insert("authorization", format!("Bearer {t}").parse().unwrap());
    }
    r
}

async fn channel(addr: &str) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap_or_else(|e| panic!("connect to {addr}: {e}"))
}

/// A normal request through the router with the client key: served, `n` tokens.
async fn served(cluster: &Cluster) {
    let mut c = v1::ferry_client::FerryClient::new(channel(&cluster.router).await);
    let t = Instant::now();
    let mut s = c.generate(with_bearer(token_request(&[1, 504, 3575, 314], 4), Some(KEY))).await.expect("a normal request is admitted").into_inner();
    let mut ids = Vec::new();
    while let Some(m) = s.message().await.expect("a normal request streams") {
        if let Some(v1::generate_response::Event::Delta(d)) = m.event {
            ids.extend(d.token_ids);
        }
    }
    assert_eq!(ids.len(), 4, "a normal request is served in full");
    assert!(t.elapsed() < Duration::from_secs(30), "a normal request took {:?}", t.elapsed());
}

/// The credentials an attacker might hold or guess: none, a client key, a wrong secret.
const TRIED: [Option<&str>; 3] = [None, Some(KEY), Some("guessed-cluster-secret-0123")];

fn refused<T: std::fmt::Debug>(what: &str, r: Result<T, tonic::Status>) {
    let e = r.expect_err(what);
    assert_eq!(e.code(), Code::Unauthenticated, "{what}: {e:?}");
    assert!(!e.message().is_empty() && e.message().len() < 300, "{what}: {:?}", e.message());
}

/// Item 2: the workers' gRPC services take no caller without the cluster secret: no `Decode`
/// admission (which would hold KV blocks for the caller's timeout), no `Prefill` (which would push a
/// prompt's KV to the caller's address: the listener here sees no connection), no `PushKv`.
async fn worker_ports_refuse_strangers(cluster: &Cluster) {
    let sink = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let sink_addr = sink.local_addr().unwrap().to_string();
    for w in &cluster.workers {
        let ch = channel(&w.grpc).await;
        for cred in TRIED {
            if w.role == "decode" {
                let admission = v1::DecodeRequest { prompt_tokens: 4, prompt: vec![1, 504, 3575, 314], kv_timeout_ms: 600_000, transfer_token: "0".repeat(32), ..Default::default() };
                let r = v1::decode_client::DecodeClient::new(ch.clone()).decode(with_bearer(admission, cred)).await;
                refused(&format!("Decode on {} with {cred:?}", w.name), r.map(drop));
                let push = tokio_stream::iter(vec![v1::KvChunk::default()]);
                let r = v1::kv_transfer_client::KvTransferClient::new(ch.clone()).push_kv(with_bearer(push, cred)).await;
                refused(&format!("PushKv on {} with {cred:?}", w.name), r.map(drop));
            } else {
                let target = v1::KvTarget { grpc_addr: sink_addr.clone(), data_addr: sink_addr.clone(), transfer_token: "0".repeat(32), transport: v1::KvTransport::Tcp as i32, ..Default::default() };
                let req = v1::PrefillRequest { prompt: vec![1, 504, 3575, 314], target: Some(target), ..Default::default() };
                let r = v1::prefill_client::PrefillClient::new(ch.clone()).prefill(with_bearer(req, cred)).await;
                refused(&format!("Prefill on {} with {cred:?}", w.name), r.map(drop));
            }
        }
    }
    let dialed = tokio::time::timeout(Duration::from_millis(500), sink.accept()).await;
    assert!(dialed.is_err(), "a worker dialed the address a stranger named");
}

/// Item 2: the decode workers' KV data port reads nothing past a connection's first frame unless
/// it is a hello with the cluster secret: a wrong secret and a stream of garbage are both
/// answered UNAUTHENTICATED (the reply frame's code 16) and closed.
async fn kv_data_port_refuses_strangers(cluster: &Cluster) {
    let decode = cluster.workers.iter().find(|w| w.role == "decode" && w.data != "-").expect("a decode worker with a data port");
    let mut hello = vec![0u8; 32];
    hello[0..4].copy_from_slice(b"FKV1");
    hello[4] = 8;
    let secret = b"guessed-cluster-secret-0123";
    hello[8..16].copy_from_slice(&(secret.len() as u64).to_le_bytes());
    hello.extend_from_slice(secret);
    for first in [hello, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".repeat(4)] {
        let mut s = tokio::net::TcpStream::connect(&decode.data).await.unwrap();
        s.write_all(&first).await.unwrap();
        let mut reply = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut reply)).await.expect("the port answers and closes").ok();
        assert!(reply.len() > 32 && &reply[0..4] == b"FKV1" && reply[4] == 5, "a reply frame, then the close: {reply:?}");
        let body = String::from_utf8_lossy(&reply[32..]).into_owned();
        assert!(body.contains("refused the connection"), "{body}");
    }
}

/// Item 3: nobody registers a worker without the cluster secret: not with a client key, not with
/// the admin token; the router lists the same workers afterwards.
async fn registration_refuses_strangers(cluster: &Cluster) {
    let before = cluster.workers().await.len();
    let ch = channel(&cluster.router).await;
    let fake = v1::RegisterRequest { role: v1::WorkerRole::Colocated as i32, grpc_addr: "127.0.0.1:9".into(), fingerprint: "x".into(), max_context: 2048, ..Default::default() };
    for cred in [None, Some(KEY), Some(cluster.admin_token.as_str())] {
        let r = v1::registry_client::RegistryClient::new(ch.clone()).register(with_bearer(fake.clone(), cred)).await;
        refused(&format!("Register with {cred:?}"), r.map(drop));
    }
    assert_eq!(cluster.workers().await.len(), before);
}

/// Items 3 and 4: the admin API takes only the admin token, and `ferry up`'s scaler (whose
/// address is on the router's command line, as `ps` shows it) only the cluster secret: nobody
/// else stops the decode pool.
async fn scaling_refuses_strangers(cluster: &Cluster) {
    let router = cluster.live_routers().into_iter().next().expect("a router");
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", router.pid)).expect("the router's command line");
    let args: Vec<String> = cmdline.split(|&b| b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
    let scaler = args.iter().position(|a| a == "--local-scaler").and_then(|i| args.get(i + 1)).expect("--local-scaler ADDR").clone();
    assert!(!args.iter().any(|a| a.contains(&cluster.admin_token)), "the admin token is not on a command line");
    let to_zero = v1::ScaleRequest { role: v1::WorkerRole::Decode as i32, replicas: 0 };
    for cred in TRIED.into_iter().chain([Some(cluster.admin_token.as_str())]) {
        let r = v1::scaler_client::ScalerClient::new(channel(&scaler).await).scale(with_bearer(to_zero, cred)).await;
        refused(&format!("Scaler.Scale with {cred:?}"), r.map(drop));
    }
    for cred in TRIED {
        let r = v1::admin_client::AdminClient::new(channel(&cluster.router).await).scale(with_bearer(to_zero, cred)).await;
        refused(&format!("Admin.Scale with {cred:?}"), r.map(drop));
    }
    let decode_ready = cluster.workers().await.iter().filter(|w| w.role == v1::WorkerRole::Decode as i32 && w.state == v1::WorkerState::Ready as i32).count();
    assert_eq!(decode_ready, 1, "the decode pool is untouched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_attack_is_refused_and_the_cluster_still_serves() {
    let model = smollm2();
    let cluster = Cluster::up(&model, 1, 1, &["--api-key", KEY]);
    served(&cluster).await;
    worker_ports_refuse_strangers(&cluster).await;
    served(&cluster).await;
    kv_data_port_refuses_strangers(&cluster).await;
    served(&cluster).await;
    registration_refuses_strangers(&cluster).await;
    scaling_refuses_strangers(&cluster).await;
    served(&cluster).await;
    // Every process is still the one first started, and nothing is held.
    for w in &cluster.workers {
        assert!(cluster.live_workers().iter().any(|l| l.name == w.name && l.pid == w.pid), "{} was restarted", w.name);
    }
    cluster.assert_no_leaks().await;
}
