//! API keys on the client APIs: gRPC `Ferry` answers UNAUTHENTICATED and HTTP `/v1/*` answers 401
//! without the right `Bearer` key, and nothing reaches a worker; the right key works; registration
//! takes the cluster secret and the admin API the admin token; with nothing configured everything
//! is open (the library default; the `ferry` commands never start open unless told to).

mod common;

use std::sync::atomic::Ordering;

use common::http::{self, request};
use common::{TestRouter, generate, prompt, scripted};
use ferry_core::WorkerRole;
use ferry_proto::v1;
use ferry_router::{ApiKeys, Listeners, RouterConfig};
use serde_json::json;
use tonic::Code;

const SCRIPT: &str = " Four.";

async fn router(keys: ApiKeys) -> (TestRouter, String) {
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = http.local_addr().unwrap().to_string();
    let cfg = RouterConfig {
        api_keys: keys,
        ..RouterConfig::new(common::model_path())
    };
    let listeners = Listeners {
        grpc,
        http: Some(http),
        metrics: None,
    };
    (TestRouter::with(cfg, listeners).await, addr)
}

fn with_key<T>(mut req: tonic::Request<T>, key: &str) -> tonic::Request<T> {
    req.metadata_mut()
        .insert("authorization", format!("Bearer {key}").parse().unwrap());
    req
}

#[tokio::test]
async fn keys_guard_the_client_apis_only() {
    let (r, addr) = router(ApiKeys::new(["key-one", "key-two"])).await;
    // Workers register and heartbeat without a key (Registry is not guarded).
    let p = r.mock(WorkerRole::Prefill, scripted(SCRIPT)).await;
    let d = r.mock(WorkerRole::Decode, scripted(SCRIPT)).await;
    let mut c = r.client().await;

    // gRPC: missing or wrong key.
    let err = generate(&mut c, prompt("Hi")).await.err().expect("refused");
    assert_eq!(err.code(), Code::Unauthenticated, "{err}");
    assert!(err.message().contains("missing"), "{err}");
    for bad in ["key-three", "key-on", "key-one2", ""] {
        let err = c
            .generate(with_key(tonic::Request::new(prompt("Hi")), bad))
            .await
            .err()
            .expect("refused");
        assert_eq!(err.code(), Code::Unauthenticated, "{bad:?}: {err}");
    }
    let err = c.health(v1::HealthRequest {}).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);

    // HTTP: missing or wrong key, on every route.
    let req = json!({"model": common::text().name, "prompt": "Hi"}).to_string();
    for key in [None, Some("nope"), Some("KEY-ONE")] {
        for (method, path, body) in [
            ("POST", "/v1/completions", Some(req.as_str())),
            ("POST", "/v1/chat/completions", Some("{}")),
            ("GET", "/v1/models", None),
            ("GET", "/v1/nothing-here", None),
        ] {
            let a = request(&addr, method, path, key, body).await;
            let e = a.error(401);
            assert_eq!(e["type"], "authentication_error", "{path}: {e}");
            assert_eq!(e["code"], "invalid_api_key");
            assert!(
                !a.body.contains("key-one"),
                "no key in the answer: {}",
                a.body
            );
        }
    }
    // A header that is not `Bearer KEY`.
    let a = request(&addr, "GET", "/v1/models", None, None).await;
    assert!(
        a.error(401)["message"]
            .as_str()
            .unwrap()
            .contains("Authorization")
    );

    // Nothing ran.
    assert_eq!(p.stats.prefill_calls.load(Ordering::Relaxed), 0);
    assert_eq!(d.stats.decode_calls.load(Ordering::Relaxed), 0);

    // The right keys work, on both APIs.
    for key in ["key-one", "key-two"] {
        let mut s = c
            .generate(with_key(tonic::Request::new(prompt("Hi")), key))
            .await
            .unwrap()
            .into_inner();
        let mut text = String::new();
        while let Some(m) = s.message().await.unwrap() {
            if let Some(v1::generate_response::Event::Delta(d)) = m.event {
                text.push_str(&d.text);
            }
        }
        assert_eq!(text, SCRIPT);
        let a = request(&addr, "POST", "/v1/completions", Some(key), Some(&req)).await;
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(a.json()["choices"][0]["text"], SCRIPT);
    }
    assert_eq!(d.stats.decode_calls.load(Ordering::Relaxed), 4);

    // Operators' Admin service is not guarded by the client keys.
    let ws = r
        .admin()
        .await
        .list_workers(v1::ListWorkersRequest {})
        .await
        .unwrap()
        .into_inner()
        .workers;
    assert_eq!(ws.len(), 2);
    r.shutdown().await;
}

#[tokio::test]
async fn without_keys_everything_is_open() {
    let (r, addr) = router(ApiKeys::default()).await;
    let _p = r.mock(WorkerRole::Prefill, scripted(SCRIPT)).await;
    let _d = r.mock(WorkerRole::Decode, scripted(SCRIPT)).await;
    let mut c = r.client().await;
    assert_eq!(generate(&mut c, prompt("Hi")).await.unwrap().text, SCRIPT);
    // A key sent anyway is ignored.
    let out = c
        .generate(with_key(tonic::Request::new(prompt("Hi")), "whatever"))
        .await;
    assert!(out.is_ok());
    let a = http::get(&addr, "/v1/models").await;
    assert_eq!(a.status, 200, "{}", a.body);
    let req = json!({"model": common::text().name, "prompt": "Hi"}).to_string();
    let a = request(
        &addr,
        "POST",
        "/v1/completions",
        Some("whatever"),
        Some(&req),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.body);
    r.shutdown().await;
}

const CLUSTER: &str = "cluster-secret-0123456789";

/// Registration takes the cluster secret (never the admin token or a client key), the admin API
/// the admin token (never the cluster secret while a token is set, never a client key).
#[tokio::test]
async fn the_cluster_secret_guards_registration_and_the_admin_token_the_admin_api() {
    let cfg = RouterConfig {
        admin_token: ferry_router::AdminToken::new(Some("s3cret-admin")),
        api_keys: ApiKeys::new(["client-key"]),
        cluster_secret: ferry_proto::ClusterSecret::new(CLUSTER).unwrap(),
        ..RouterConfig::new(common::model_path())
    };
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let r = TestRouter::with(cfg, Listeners::grpc(grpc)).await;
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", r.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut reg = v1::registry_client::RegistryClient::new(ch.clone());
    let mut adm = v1::admin_client::AdminClient::new(ch.clone());
    let registration = || v1::RegisterRequest {
        role: v1::WorkerRole::Decode as i32,
        grpc_addr: "127.0.0.1:9".into(),
        fingerprint: "fp".into(),
        max_context: 2048,
        ..Default::default()
    };
    fn req<T>(r: T, key: Option<&str>) -> tonic::Request<T> {
        match key {
            Some(k) => with_key(tonic::Request::new(r), k),
            None => tonic::Request::new(r),
        }
    }
    // Without the secret, with a client API key or with the admin token, nothing registers.
    for key in [None, Some("client-key"), Some("wrong"), Some("s3cret-admin")] {
        let err = reg.register(req(registration(), key)).await.unwrap_err();
        assert_eq!(err.code(), Code::Unauthenticated, "{key:?}: {err:?}");
        assert!(err.message().contains("cluster secret"), "{}", err.message());
    }
    // Without the admin token (the cluster secret included: a token is set), nothing is listed
    // or scaled.
    for key in [None, Some("client-key"), Some("wrong"), Some(CLUSTER)] {
        let err = adm
            .list_workers(req(v1::ListWorkersRequest {}, key))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::Unauthenticated, "{key:?}: {err:?}");
        let err = adm
            .scale(req(
                v1::ScaleRequest {
                    role: v1::WorkerRole::Decode as i32,
                    replicas: 3,
                },
                key,
            ))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::Unauthenticated, "{key:?}: {err:?}");
    }
    // The secret registers, the token lists, and what registered is the only worker.
    let id = reg
        .register(with_key(tonic::Request::new(registration()), CLUSTER))
        .await
        .unwrap()
        .into_inner()
        .worker_id;
    let ws = adm
        .list_workers(with_key(
            tonic::Request::new(v1::ListWorkersRequest {}),
            "s3cret-admin",
        ))
        .await
        .unwrap()
        .into_inner()
        .workers;
    assert_eq!(
        ws.iter().map(|w| w.worker_id.clone()).collect::<Vec<_>>(),
        vec![id]
    );
    // Clients use their own key, not the admin token.
    let mut c = v1::ferry_client::FerryClient::new(ch);
    let err = c
        .health(with_key(
            tonic::Request::new(v1::HealthRequest {}),
            "s3cret-admin",
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    c.health(with_key(
        tonic::Request::new(v1::HealthRequest {}),
        "client-key",
    ))
    .await
    .unwrap();
    r.shutdown().await;
}

/// With no admin token, the admin API is as closed as the cluster: it takes the cluster secret,
/// and nothing else.
#[tokio::test]
async fn without_an_admin_token_the_admin_api_takes_the_cluster_secret() {
    let cfg = RouterConfig {
        cluster_secret: ferry_proto::ClusterSecret::new(CLUSTER).unwrap(),
        ..RouterConfig::new(common::model_path())
    };
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let r = TestRouter::with(cfg, Listeners::grpc(grpc)).await;
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", r.addr)).unwrap().connect().await.unwrap();
    let mut adm = v1::admin_client::AdminClient::new(ch);
    for key in [None, Some("wrong-wrong-wrong-wrong")] {
        let mut call = tonic::Request::new(v1::ListWorkersRequest {});
        if let Some(k) = key {
            call = with_key(call, k);
        }
        let err = adm.list_workers(call).await.unwrap_err();
        assert_eq!(err.code(), Code::Unauthenticated, "{key:?}: {err:?}");
    }
    adm.list_workers(with_key(tonic::Request::new(v1::ListWorkersRequest {}), CLUSTER)).await.unwrap();
    r.shutdown().await;
}

/// The router presents the cluster secret on every call to its workers (the mocks refuse any
/// call without it), so a request is served end to end; a worker holding another secret cannot
/// register.
#[tokio::test]
async fn the_router_presents_the_cluster_secret_to_its_workers() {
    let secret = ferry_proto::ClusterSecret::new(CLUSTER).unwrap();
    let cfg = RouterConfig { cluster_secret: secret.clone(), ..RouterConfig::new(common::model_path()) };
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let r = TestRouter::with(cfg, Listeners::grpc(grpc)).await;
    let with_secret = |s: &ferry_proto::ClusterSecret| ferry_testkit::MockConfig { cluster: s.clone(), ..scripted(SCRIPT) };
    let p = r.mock(WorkerRole::Prefill, with_secret(&secret)).await;
    let d = r.mock(WorkerRole::Decode, with_secret(&secret)).await;
    let out = generate(&mut r.client().await, prompt("Hi")).await.unwrap();
    assert_eq!(out.text, SCRIPT);
    assert_eq!((p.stats.prefill_calls.load(Ordering::Relaxed), d.stats.decode_calls.load(Ordering::Relaxed)), (1, 1));
    let other = ferry_proto::ClusterSecret::new("another-secret-0123456789").unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let refused = ferry_testkit::MockWorker::start(WorkerRole::Decode, l, &r.addr, with_secret(&other)).await.err().expect("refused");
    assert!(refused.to_string().contains("cluster secret"), "{refused}");
    r.shutdown().await;
}

/// Each key is a tenant of the workers' prefix caches, on both APIs: the salt the router sends
/// with a request is the same for one key (and one `cache_salt`), differs between keys and
/// between salts, and is a digest, never the key.
#[tokio::test]
async fn each_key_is_a_prefix_cache_tenant_on_both_apis() {
    let (r, addr) = router(ApiKeys::new(["key-one", "key-two"])).await;
    let _p = r.mock(WorkerRole::Prefill, scripted(SCRIPT)).await;
    let d = r.mock(WorkerRole::Decode, scripted(SCRIPT)).await;
    let mut c = r.client().await;
    let grpc = |salt: &str| {
        let req = v1::GenerateRequest { cache_salt: salt.into(), ..prompt("Hi") };
        with_key(tonic::Request::new(req), "key-one")
    };
    let body = |salt: Option<&str>| {
        let mut b = json!({"model": common::text().name, "prompt": "Hi"});
        if let Some(s) = salt {
            b["cache_salt"] = json!(s);
        }
        b.to_string()
    };
    c.generate(grpc("")).await.unwrap().into_inner().message().await.unwrap();
    for (key, salt) in [("key-one", None), ("key-two", None), ("key-one", Some("x"))] {
        let a = request(&addr, "POST", "/v1/completions", Some(key), Some(&body(salt))).await;
        assert_eq!(a.status, 200, "{}", a.body);
    }
    c.generate(grpc("x")).await.unwrap().into_inner().message().await.unwrap();
    let salts = d.stats.decode_salts.lock().unwrap().clone();
    assert_eq!(salts.len(), 5);
    assert_eq!(salts[0], salts[1], "one key: one tenant on gRPC and HTTP");
    assert_ne!(salts[1], salts[2], "two keys: two tenants");
    assert_ne!(salts[1], salts[3], "another cache_salt: another cache");
    assert_eq!(salts[3], salts[4], "the same key and cache_salt on both APIs");
    assert_eq!(salts[0].len(), 32, "the tenant's digest, no request salt");
    for s in &salts {
        assert!(!s.windows(7).any(|w| w == b"key-one" || w == b"key-two"), "no key in a salt");
    }
    // An over-long salt is refused before any worker is asked.
    let long = "s".repeat(257);
    let a = request(&addr, "POST", "/v1/completions", Some("key-one"), Some(&body(Some(&long)))).await;
    assert_eq!(a.error(400)["param"], "cache_salt");
    assert_eq!(d.stats.decode_salts.lock().unwrap().len(), 5);
    r.shutdown().await;
}
