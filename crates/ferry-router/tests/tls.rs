//! TLS on the router's gRPC listener, with certificates made here (rcgen) on loopback: a client
//! that verifies the router with the right CA works; a plaintext client and a client trusting
//! another CA fail; with mutual TLS, a client without a certificate or with one from another CA
//! fails the handshake, and nothing it sent was executed or registered.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{TestRouter, generate, prompt, scripted};
use ferry_core::WorkerRole;
use ferry_proto::tls::dev::{DevPki, LOOPBACK_NAMES};
use ferry_proto::tls::{ClientTls, TlsConfig, endpoint, error_chain};
use ferry_proto::v1;
use ferry_router::{Listeners, RouterConfig};

const SCRIPT: &str = " Four.";

fn client_tls(cfg: TlsConfig) -> Option<ClientTls> {
    Some(cfg.client().unwrap().expect("a client side"))
}

/// A router serving TLS with `pki`'s node certificate (mutual TLS when `mutual`).
async fn router(pki: &DevPki, mutual: bool, client: Option<ClientTls>) -> TestRouter {
    let server = TlsConfig {
        client_ca: if mutual { Some(pki.ca.clone()) } else { None },
        ..pki.node()
    };
    let cfg = RouterConfig {
        tls: ferry_proto::tls::Tls {
            server: server.server().unwrap(),
            client: None,
        },
        ..RouterConfig::new(common::model_path())
    };
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut r = TestRouter::with(cfg, Listeners::grpc(grpc)).await;
    r.client_tls = client;
    r
}

/// Connect and call `Health`; the whole error chain on failure. Never hangs: a bound says so.
async fn health(addr: &str, tls: Option<&ClientTls>) -> Result<(), String> {
    let call = async {
        let ch = endpoint(addr, tls)
            .map_err(|e| e.to_string())?
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await
            .map_err(|e| error_chain(&e))?;
        v1::ferry_client::FerryClient::new(ch)
            .health(v1::HealthRequest {})
            .await
            .map_err(|s| error_chain(&s))?;
        Ok(())
    };
    tokio::time::timeout(Duration::from_secs(30), call)
        .await
        .expect("a refused TLS client fails, it does not hang")
}

/// Try to register a decode worker; the error chain on failure.
async fn register(addr: &str, tls: Option<&ClientTls>) -> Result<(), String> {
    let call = async {
        let ch = endpoint(addr, tls)
            .map_err(|e| e.to_string())?
            .connect()
            .await
            .map_err(|e| error_chain(&e))?;
        let req = v1::RegisterRequest {
            role: v1::WorkerRole::Decode as i32,
            grpc_addr: "127.0.0.1:9".into(),
            fingerprint: "mock-fingerprint".into(),
            max_context: 2048,
            ..Default::default()
        };
        v1::registry_client::RegistryClient::new(ch)
            .register(req)
            .await
            .map_err(|s| error_chain(&s))?;
        Ok(())
    };
    tokio::time::timeout(Duration::from_secs(30), call)
        .await
        .expect("no hang")
}

fn says_tls(err: &str) -> bool {
    let e = err.to_ascii_lowercase();
    ["tls", "certificate", "handshake", "alert"]
        .iter()
        .any(|w| e.contains(w))
}

#[tokio::test]
async fn tls_clients_with_the_right_ca_work_others_fail() {
    let pki = DevPki::temp(LOOPBACK_NAMES).unwrap();
    let other = DevPki::temp(LOOPBACK_NAMES).unwrap();
    let ca_only = client_tls(TlsConfig {
        ca: Some(pki.ca.clone()),
        ..TlsConfig::default()
    });
    let r = router(&pki, false, ca_only.clone()).await;
    // A worker dials the router over TLS and registers; a client generates over TLS.
    let mock = |role| {
        let cfg = ferry_testkit::MockConfig {
            router_tls: ca_only.clone(),
            ..scripted(SCRIPT)
        };
        r.mock(role, cfg)
    };
    let p = mock(WorkerRole::Prefill).await;
    let d = mock(WorkerRole::Decode).await;
    let out = generate(&mut r.client().await, prompt("Hi")).await.unwrap();
    assert_eq!(out.text, SCRIPT);
    assert_eq!(d.stats.decode_calls.load(Ordering::Relaxed), 1);

    // Plaintext to the TLS port: refused.
    let err = health(&r.addr, None).await.unwrap_err();
    eprintln!("plaintext client: {err}");
    // A client that trusts another CA refuses the router's certificate.
    let err = health(&r.addr, client_tls(other.client()).as_ref())
        .await
        .unwrap_err();
    assert!(says_tls(&err), "{err}");
    assert!(
        err.contains("UnknownIssuer") || err.contains("BadSignature"),
        "{err}"
    );
    // The certificate must name the host dialed: `localhost` is in it, `ferry.invalid` is not.
    let renamed = client_tls(TlsConfig {
        ca: Some(pki.ca.clone()),
        server_name: Some("ferry.invalid".into()),
        ..TlsConfig::default()
    });
    let err = health(&r.addr, renamed.as_ref()).await.unwrap_err();
    assert!(says_tls(&err) && err.contains("not valid for name"), "{err}");
    let renamed = client_tls(TlsConfig {
        ca: Some(pki.ca.clone()),
        server_name: Some("localhost".into()),
        ..TlsConfig::default()
    });
    health(&r.addr, renamed.as_ref()).await.unwrap();
    // Nothing of the failed clients ran.
    assert_eq!(p.stats.prefill_calls.load(Ordering::Relaxed), 1);
    assert_eq!(d.stats.decode_calls.load(Ordering::Relaxed), 1);
    r.shutdown().await;
}

#[tokio::test]
async fn mutual_tls_refuses_clients_without_a_certificate_from_the_ca() {
    let pki = DevPki::temp(LOOPBACK_NAMES).unwrap();
    let other = DevPki::temp(LOOPBACK_NAMES).unwrap();
    let r = router(&pki, true, client_tls(pki.client())).await;
    // Workers present the node certificate.
    let mock = |role| {
        let cfg = ferry_testkit::MockConfig {
            router_tls: client_tls(pki.node()),
            ..scripted(SCRIPT)
        };
        r.mock(role, cfg)
    };
    let p = mock(WorkerRole::Prefill).await;
    let d = mock(WorkerRole::Decode).await;
    let out = generate(&mut r.client().await, prompt("Hi")).await.unwrap();
    assert_eq!(out.text, SCRIPT);

    let no_cert = client_tls(TlsConfig {
        ca: Some(pki.ca.clone()),
        ..TlsConfig::default()
    });
    // A certificate from another CA (the client trusts the router's CA, so only its own
    // certificate is wrong).
    let foreign = client_tls(TlsConfig {
        ca: Some(pki.ca.clone()),
        ..other.client()
    });
    for (what, tls) in [
        ("plaintext", None),
        ("no client certificate", no_cert.as_ref()),
        ("a certificate from another CA", foreign.as_ref()),
    ] {
        let err = health(&r.addr, tls).await.unwrap_err();
        eprintln!("{what}: {err}");
        if tls.is_some() {
            assert!(says_tls(&err), "{what}: {err}");
        }
        let err = register(&r.addr, tls).await.unwrap_err();
        if tls.is_some() {
            assert!(says_tls(&err), "{what}: {err}");
        }
        // Generate over such a channel fails too, and reaches no worker.
        let ch = endpoint(&r.addr, tls).unwrap().connect_lazy();
        let mut c = v1::ferry_client::FerryClient::new(ch);
        let call = tokio::time::timeout(Duration::from_secs(30), generate(&mut c, prompt("Hi")));
        assert!(call.await.expect("no hang").is_err(), "{what}");
    }
    // Nothing was registered or executed for them: the two mocks only, one request each.
    let mut admin = r.admin().await;
    let workers = admin
        .list_workers(v1::ListWorkersRequest {})
        .await
        .unwrap()
        .into_inner()
        .workers;
    assert_eq!(workers.len(), 2, "{workers:?}");
    assert_eq!(p.stats.prefill_calls.load(Ordering::Relaxed), 1);
    assert_eq!(d.stats.decode_calls.load(Ordering::Relaxed), 1);
    // The right certificate still works.
    let out = generate(&mut r.client().await, prompt("Hi")).await.unwrap();
    assert_eq!(out.text, SCRIPT);
    r.shutdown().await;
}
