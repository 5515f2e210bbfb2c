//! Pool scaling behind `Admin.Scale` (`ferry pool scale prefill|decode N`). Two backends:
//!
//! - **Kubernetes** (the `kube` feature; without it, asking for it is
//!   [`RouterError::KubeNotCompiled`]): each pool is a Deployment; the router reads and patches its `scale`
//!   subresource with the in-cluster service account or a kubeconfig (`kube::Config::infer`), or
//!   through `kubectl proxy` (`--kube-api-url`). Pods that go away get SIGTERM and drain
//!   themselves ([`ferry_worker`'s drain]), so scaling down loses no request.
//! - **Local**: `ferry up`'s supervisor owns the worker processes and serves `ferry.v1.Scaler`;
//!   the router forwards to it.
//!
//! The router stays the one place operators talk to, whatever runs the workers.

use std::time::Duration;

use ferry_core::WorkerRole;
use ferry_proto::v1;
#[cfg(feature = "kube")]
use k8s_openapi::api::apps::v1::Deployment;
#[cfg(feature = "kube")]
use kube::api::{Api, Patch, PatchParams};

use crate::RouterError;
use crate::wire::role_to_wire;

/// Where `Admin.Scale` goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scaler {
    /// `ferry up`'s supervisor, serving `ferry.v1.Scaler` at this address.
    Local(String),
    Kubernetes(KubeScale),
}

/// The Deployments behind the pools.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubeScale {
    /// Namespace of the Deployments (None: the service account's, or the kubeconfig context's).
    pub namespace: Option<String>,
    pub prefill_deployment: String,
    pub decode_deployment: String,
    pub colocated_deployment: String,
    /// Talk to this API server URL without credentials (e.g. `kubectl proxy`'s
    /// `http://127.0.0.1:8001`) instead of inferring the config.
    pub api_url: Option<String>,
}

impl Default for KubeScale {
    fn default() -> Self {
        KubeScale {
            namespace: None,
            prefill_deployment: "ferry-prefill".into(),
            decode_deployment: "ferry-decode".into(),
            colocated_deployment: "ferry-colocated".into(),
            api_url: None,
        }
    }
}

impl KubeScale {
    #[cfg(feature = "kube")]
    fn deployment(&self, role: WorkerRole) -> &str {
        match role {
            WorkerRole::Prefill => &self.prefill_deployment,
            WorkerRole::Decode => &self.decode_deployment,
            WorkerRole::Colocated => &self.colocated_deployment,
        }
    }
}

/// Largest pool `Admin.Scale` accepts (a typo like 1000 should not start a thousand workers).
pub const MAX_REPLICAS: u32 = 256;

/// Whether this router can use `scaler` (a Kubernetes scaler needs the `kube` feature), checked
/// when the router starts.
pub fn check(scaler: Option<&Scaler>) -> Result<(), RouterError> {
    match scaler {
        Some(Scaler::Kubernetes(_)) if !cfg!(feature = "kube") => Err(RouterError::KubeNotCompiled),
        _ => Ok(()),
    }
}

/// Sets `role`'s pool to `replicas` workers through `scaler`.
pub async fn scale(
    scaler: Option<&Scaler>,
    dial: &crate::workers::dial::DialOptions,
    role: WorkerRole,
    replicas: u32,
) -> Result<v1::ScaleResponse, RouterError> {
    if replicas > MAX_REPLICAS {
        return Err(RouterError::InvalidRequest(format!(
            "{replicas} replicas is more than the limit of {MAX_REPLICAS}"
        )));
    }
    match scaler {
        None => Err(RouterError::NoScaler),
        Some(Scaler::Local(addr)) => local(addr, dial, role, replicas).await,
        Some(Scaler::Kubernetes(k)) => kubernetes(k, role, replicas).await,
    }
}

async fn local(
    addr: &str,
    dial: &crate::workers::dial::DialOptions,
    role: WorkerRole,
    replicas: u32,
) -> Result<v1::ScaleResponse, RouterError> {
    let failed = |message: String| RouterError::ScaleFailed {
        backend: format!("ferry up at {addr}"),
        message,
    };
    let dial = crate::workers::dial::DialOptions {
        connect_timeout: Duration::from_secs(1),
        ..dial.clone()
    };
    let channel = crate::workers::dial::endpoint(addr, &dial)?
        .connect()
        .await
        .map_err(|e| {
            failed(format!(
                "cannot connect: {}",
                ferry_proto::tls::error_chain(&e)
            ))
        })?;
    let req = v1::ScaleRequest {
        role: role_to_wire(role) as i32,
        replicas,
    };
    v1::scaler_client::ScalerClient::with_interceptor(channel, dial.cluster.bearer())
        .scale(req)
        .await
        .map(|r| r.into_inner())
        .map_err(|s| failed(format!("{:?}: {}", s.code(), s.message())))
}

#[cfg(not(feature = "kube"))]
async fn kubernetes(
    _: &KubeScale,
    _: WorkerRole,
    _: u32,
) -> Result<v1::ScaleResponse, RouterError> {
    Err(RouterError::KubeNotCompiled)
}

#[cfg(feature = "kube")]
async fn kubernetes(
    k: &KubeScale,
    role: WorkerRole,
    replicas: u32,
) -> Result<v1::ScaleResponse, RouterError> {
    let config = match &k.api_url {
        Some(url) => {
            let uri = url.parse().map_err(|e| RouterError::ScaleFailed {
                backend: "kubernetes".into(),
                message: format!("--kube-api-url {url:?}: {e}"),
            })?;
            kube::Config::new(uri)
        }
        None => kube::Config::infer().await.map_err(|e| RouterError::ScaleFailed {
            backend: "kubernetes".into(),
            message: format!("no in-cluster service account or kubeconfig: {e}"),
        })?,
    };
    let namespace = k
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    let name = k.deployment(role);
    let backend = format!("kubernetes deployment {namespace}/{name}");
    let failed = |e: kube::Error| RouterError::ScaleFailed {
        backend: backend.clone(),
        message: e.to_string(),
    };
    let client = kube::Client::try_from(config).map_err(failed)?;
    let api: Api<Deployment> = Api::namespaced(client, &namespace);
    let before = api.get_scale(name).await.map_err(failed)?;
    let previous = before.spec.and_then(|s| s.replicas).unwrap_or(0).max(0) as u32;
    let patch = serde_json::json!({ "spec": { "replicas": replicas } });
    let after = api
        .patch_scale(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(failed)?;
    let now = after.spec.and_then(|s| s.replicas).unwrap_or(0).max(0) as u32;
    tracing::info!(%backend, previous, replicas = now, "scaled");
    Ok(v1::ScaleResponse {
        role: role_to_wire(role) as i32,
        previous,
        replicas: now,
        backend,
        started: Vec::new(),
        stopping: Vec::new(),
    })
}
