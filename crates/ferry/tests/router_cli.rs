//! The router's client CLI pieces (`ferry generate --router`, `ferry pool`) against an in-process
//! router with mock workers. The two modules are compiled into this test directly.

#[path = "../src/pool_cmd.rs"]
mod pool_cmd;
#[allow(dead_code)]
#[path = "../src/remote.rs"]
mod remote;

use ferry_core::{SamplingParams, WorkerRole};
use ferry_router::{MockConfig, MockWorker, RouterConfig};

fn model() -> std::path::PathBuf {
    std::env::var_os("FERRY_SMOLLM2_GGUF").map(Into::into).unwrap_or_else(|| ferry_engine::fetch::ensure_default_model().expect("default model"))
}

#[test]
fn remote_generate_and_pool_commands() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let l = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let router = rt.spawn(ferry_router::serve(RouterConfig::new(model()), l, None, async move {
        let _ = stopped.await;
    }));
    let req = remote::RemoteGenerate { router: addr.clone(), prompt: "Hi".into(), chat: true, system: Some("Be brief.".into()), params: SamplingParams::greedy(8) };

    // The router answers (readiness) but has no workers: UNAVAILABLE, as `<code>: <message>`.
    let mut err = None;
    for _ in 0..500 {
        match remote::generate_to(&req, &mut Vec::new()) {
            Err(e) if e.to_string().contains("cannot connect") => std::thread::sleep(std::time::Duration::from_millis(10)),
            Err(e) => {
                err = Some(e);
                break;
            }
            Ok(_) => panic!("no workers yet"),
        }
    }
    assert!(err.unwrap().to_string().starts_with("Unavailable: "));

    let text = ferry_tokenizer::ModelText::open(&model()).unwrap();
    let ids = text.encode_prompt(" Four.").unwrap();
    let cfg = MockConfig { first_token: ids[0], tokens: ids[1..].to_vec(), ..Default::default() };
    let _workers: Vec<MockWorker> = [WorkerRole::Prefill, WorkerRole::Decode]
        .into_iter()
        .map(|role| {
            rt.block_on(async {
                let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                MockWorker::start(role, l, &addr, cfg.clone()).await.unwrap()
            })
        })
        .collect();

    let mut out = Vec::new();
    let fin = remote::generate_to(&req, &mut out).unwrap();
    assert_eq!(String::from_utf8(out).unwrap(), " Four.");
    let line = remote::stats_line(&fin);
    assert!(line.contains("finish StopToken") && line.contains("prefill=prefill-1 decode=decode-1 kv=4096 in 0.05 ms (grpc)"), "{line}");

    let opts = |json| pool_cmd::PoolOpts { router: addr.clone(), json };
    pool_cmd::run(pool_cmd::PoolArgs { command: pool_cmd::PoolCommand::List(opts(false)) }).unwrap();
    pool_cmd::run(pool_cmd::PoolArgs { command: pool_cmd::PoolCommand::Drain(pool_cmd::PoolWorker { opts: opts(true), worker_id: "decode-1".into() }) }).unwrap();
    let e = pool_cmd::run(pool_cmd::PoolArgs { command: pool_cmd::PoolCommand::Remove(pool_cmd::PoolWorker { opts: opts(false), worker_id: "decode-9".into() }) }).unwrap_err();
    assert!(e.to_string().starts_with("NotFound: "), "{e}");
    assert!(remote::generate_to(&req, &mut Vec::new()).unwrap_err().to_string().starts_with("Unavailable: "));

    let _ = stop.send(());
    rt.block_on(router).unwrap().unwrap();
}
