//! The router's client CLI pieces (`ferry generate --router`, `ferry pool`) against an in-process
//! router with mock workers. The two modules are compiled into this test directly.

#[path = "../src/pool_cmd.rs"]
mod pool_cmd;
#[allow(dead_code)]
#[path = "../src/tls_args.rs"]
mod tls_args;
#[allow(dead_code)]
#[path = "../src/remote.rs"]
mod remote;

use ferry_core::{SamplingParams, WorkerRole};
use ferry_router::RouterConfig;
use ferry_testkit::{MockConfig, MockWorker};

fn model() -> std::path::PathBuf {
    std::env::var_os("FERRY_SMOLLM2_GGUF").map(Into::into).unwrap_or_else(|| ferry_engine::fetch::ensure_default_model().expect("default model"))
}

#[test]
fn remote_generate_and_pool_commands() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let l = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let router = rt.spawn(ferry_router::serve(RouterConfig::new(model()), ferry_router::Listeners::grpc(l), async move {
        let _ = stopped.await;
    }));
    let req = remote::RemoteGenerate { router: addr.clone(), prompt: "Hi".into(), chat: true, system: Some("Be brief.".into()), params: SamplingParams::greedy(8), api_key: None, tls: None };

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

    let opts = |json| pool_cmd::PoolOpts { router: addr.clone(), json, admin_token: None, admin_token_file: None, tls: Default::default() };
    pool_cmd::run(pool_cmd::PoolArgs { command: pool_cmd::PoolCommand::List(opts(false)) }).unwrap();
    pool_cmd::run(pool_cmd::PoolArgs { command: pool_cmd::PoolCommand::Drain(pool_cmd::PoolWorker { opts: opts(true), worker_id: "decode-1".into() }) }).unwrap();
    let e = pool_cmd::run(pool_cmd::PoolArgs { command: pool_cmd::PoolCommand::Remove(pool_cmd::PoolWorker { opts: opts(false), worker_id: "decode-9".into() }) }).unwrap_err();
    assert!(e.to_string().starts_with("NotFound: "), "{e}");
    assert!(remote::generate_to(&req, &mut Vec::new()).unwrap_err().to_string().starts_with("Unavailable: "));

    let _ = stop.send(());
    rt.block_on(router).unwrap().unwrap();
}

#[test]
fn remote_generate_sends_the_api_key() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let l = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let cfg = RouterConfig { api_keys: ferry_router::ApiKeys::new(["sesame"]), ..RouterConfig::new(model()) };
    let router = rt.spawn(ferry_router::serve(cfg, ferry_router::Listeners::grpc(l), async move {
        let _ = stopped.await;
    }));
    let text = ferry_tokenizer::ModelText::open(&model()).unwrap();
    let ids = text.encode_prompt(" Open.").unwrap();
    let mock = MockConfig { first_token: ids[0], tokens: ids[1..].to_vec(), ..Default::default() };
    // Workers register without a key (the registry is not guarded by the client keys).
    let _workers: Vec<MockWorker> = [WorkerRole::Prefill, WorkerRole::Decode]
        .into_iter()
        .map(|role| {
            rt.block_on(async {
                let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                MockWorker::start(role, l, &addr, mock.clone()).await.unwrap()
            })
        })
        .collect();
    let req = |key: Option<&str>| remote::RemoteGenerate {
        router: addr.clone(),
        prompt: "Hi".into(),
        chat: false,
        system: None,
        params: SamplingParams::greedy(8),
        api_key: key.map(Into::into),
        tls: None,
    };
    for bad in [None, Some("wrong")] {
        let e = remote::generate_to(&req(bad), &mut Vec::new()).unwrap_err();
        assert!(e.to_string().starts_with("Unauthenticated: "), "{bad:?}: {e}");
    }
    let mut out = Vec::new();
    remote::generate_to(&req(Some("sesame")), &mut out).unwrap();
    assert_eq!(String::from_utf8(out).unwrap(), " Open.");
    let _ = stop.send(());
    rt.block_on(router).unwrap().unwrap();
}
