//! `Admin.Scale` against a fake Kubernetes API server on loopback (the `scale` subresource of
//! Deployments, as `kubectl scale` uses it), and the errors without a scaler.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use common::TestRouter;
use ferry_proto::v1;
use ferry_router::{KubeScale, RouterConfig, Scaler};
use tonic::Code;

/// Deployment replicas by (namespace, name), and every PATCH seen (path, content type, body).
#[derive(Clone, Default)]
struct FakeApi {
    replicas: Arc<Mutex<HashMap<(String, String), i64>>>,
    patches: Arc<Mutex<Vec<(String, String, serde_json::Value)>>>,
}

fn scale_json(ns: &str, name: &str, n: i64) -> String {
    serde_json::json!({
        "apiVersion": "autoscaling/v1", "kind": "Scale",
        "metadata": { "name": name, "namespace": ns },
        "spec": { "replicas": n }, "status": { "replicas": n },
    })
    .to_string()
}

fn not_found(name: &str) -> axum::response::Response {
    let body = serde_json::json!({
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404,
        "message": format!("deployments.apps \"{name}\" not found"),
    });
    (StatusCode::NOT_FOUND, [("content-type", "application/json")], body.to_string()).into_response()
}

async fn get_scale(State(api): State<FakeApi>, Path((ns, name)): Path<(String, String)>) -> axum::response::Response {
    match api.replicas.lock().unwrap().get(&(ns.clone(), name.clone())) {
        Some(&n) => ([("content-type", "application/json")], scale_json(&ns, &name, n)).into_response(),
        None => not_found(&name),
    }
}

async fn patch_scale(
    State(api): State<FakeApi>,
    Path((ns, name)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> axum::response::Response {
    let patch: serde_json::Value = serde_json::from_slice(&body).expect("the patch is JSON");
    let ct = headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    api.patches.lock().unwrap().push((format!("{ns}/{name}"), ct, patch.clone()));
    let mut map = api.replicas.lock().unwrap();
    let Some(n) = map.get_mut(&(ns.clone(), name.clone())) else {
        return not_found(&name);
    };
    *n = patch["spec"]["replicas"].as_i64().expect("spec.replicas");
    ([("content-type", "application/json")], scale_json(&ns, &name, *n)).into_response()
}

async fn fake_api() -> (FakeApi, String) {
    let api = FakeApi::default();
    api.replicas.lock().unwrap().insert(("ferry".into(), "ferry-prefill".into()), 1);
    api.replicas.lock().unwrap().insert(("ferry".into(), "decoders".into()), 4);
    let app = axum::Router::new()
        .route(
            "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale",
            axum::routing::get(get_scale).patch(patch_scale),
        )
        .with_state(api.clone());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(l, app).await });
    (api, url)
}

fn scale(role: v1::WorkerRole, replicas: u32) -> v1::ScaleRequest {
    v1::ScaleRequest {
        role: role as i32,
        replicas,
    }
}

#[tokio::test]
async fn kubernetes_scaling_patches_the_pools_deployment() {
    let (api, url) = fake_api().await;
    let cfg = RouterConfig {
        scaler: Some(Scaler::Kubernetes(KubeScale {
            namespace: Some("ferry".into()),
            decode_deployment: "decoders".into(),
            api_url: Some(url),
            ..KubeScale::default()
        })),
        ..RouterConfig::new(common::model_path())
    };
    let r = TestRouter::start(cfg).await;
    let mut admin = r.admin().await;

    let resp = admin.scale(scale(v1::WorkerRole::Prefill, 3)).await.unwrap().into_inner();
    assert_eq!((resp.previous, resp.replicas), (1, 3));
    assert_eq!(resp.role, v1::WorkerRole::Prefill as i32);
    assert!(resp.backend.contains("ferry/ferry-prefill"), "{}", resp.backend);
    let resp = admin.scale(scale(v1::WorkerRole::Decode, 2)).await.unwrap().into_inner();
    assert_eq!((resp.previous, resp.replicas), (4, 2));

    let patches = api.patches.lock().unwrap().clone();
    assert_eq!(patches.len(), 2, "{patches:?}");
    assert_eq!(patches[0].0, "ferry/ferry-prefill");
    assert_eq!(patches[0].1, "application/merge-patch+json");
    assert_eq!(patches[0].2, serde_json::json!({ "spec": { "replicas": 3 } }));
    assert_eq!(patches[1].0, "ferry/decoders");
    assert_eq!(api.replicas.lock().unwrap()[&("ferry".to_string(), "decoders".to_string())], 2);

    // A pool without a Deployment: UNAVAILABLE naming it, and nothing patched.
    let err = admin.scale(scale(v1::WorkerRole::Colocated, 1)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains("ferry/ferry-colocated"), "{}", err.message());
    assert_eq!(api.patches.lock().unwrap().len(), 2);
    // Bad requests are refused before the API is called.
    let err = admin.scale(scale(v1::WorkerRole::Prefill, 100_000)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("100000"), "{}", err.message());
    let err = admin.scale(scale(v1::WorkerRole::Unspecified, 1)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert_eq!(api.patches.lock().unwrap().len(), 2);
    r.shutdown().await;
}

#[tokio::test]
async fn scaling_without_a_scaler_or_with_an_unreachable_one_says_why() {
    let r = TestRouter::start(RouterConfig::new(common::model_path())).await;
    let err = r.admin().await.scale(scale(v1::WorkerRole::Decode, 2)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("--kube-scale"), "{}", err.message());
    r.shutdown().await;

    // A `ferry up` supervisor that is gone.
    let gone = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = gone.local_addr().unwrap().to_string();
    drop(gone);
    let cfg = RouterConfig {
        scaler: Some(Scaler::Local(addr.clone())),
        ..RouterConfig::new(common::model_path())
    };
    let r = TestRouter::start(cfg).await;
    let err = r.admin().await.scale(scale(v1::WorkerRole::Decode, 2)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains(&addr), "{}", err.message());
    r.shutdown().await;
}
