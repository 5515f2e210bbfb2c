//! What the end-to-end tests of a router with real workers share: a router on a port-0 listener,
//! and one request through its client API.

use ferry_proto::v1::ferry_client::FerryClient;
use ferry_proto::v1::{generate_request, generate_response, GenerateFinal, GenerateRequest, StopConditions, TokenInput};
use ferry_router::RouterConfig;

/// A router serving on loopback until [`Router::stop`].
#[allow(dead_code)]
pub struct Router {
    pub addr: String,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), ferry_router::RouterError>>,
}

#[allow(dead_code)]
impl Router {
    pub async fn start(cfg: RouterConfig) -> Router {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(ferry_router::serve(cfg, ferry_router::Listeners::grpc(l), async move {
            let _ = stopped.await;
        }));
        Router { addr, stop, task }
    }

    pub async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap().unwrap();
    }
}

/// `prompt` as token ids, `max_tokens` new tokens with EOS ignored, under `cache_salt`.
#[allow(dead_code)]
pub fn request(prompt: &[u32], max_tokens: u32, cache_salt: &str) -> GenerateRequest {
    GenerateRequest {
        input: Some(generate_request::Input::Tokens(TokenInput { ids: prompt.to_vec() })),
        stop: Some(StopConditions { max_tokens, ignore_eos: true, ..Default::default() }),
        cache_salt: cache_salt.into(),
        ..Default::default()
    }
}

/// Run `req` on the router at `router`: the ids streamed, and the final message.
pub async fn generate(router: &str, req: GenerateRequest) -> Result<(Vec<u32>, GenerateFinal), tonic::Status> {
    generate_as(router, None, req).await
}

/// [`generate`] with an API key (`authorization: Bearer KEY`).
pub async fn generate_as(router: &str, key: Option<&str>, req: GenerateRequest) -> Result<(Vec<u32>, GenerateFinal), tonic::Status> {
    let mut c = FerryClient::connect(format!("http://{router}")).await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let mut req = tonic::Request::new(req);
    if let Some(k) = key {
        req.metadata_mut().insert("authorization", format!("Bearer {k}").parse().expect("an ASCII key"));
    }
    let mut s = c.generate(req).await?.into_inner();
    let mut ids = Vec::new();
    while let Some(m) = s.message().await? {
        match m.event {
            Some(generate_response::Event::Delta(d)) => ids.extend(d.token_ids),
            Some(generate_response::Event::Final(f)) => return Ok((ids, f)),
            Some(generate_response::Event::ToolCall(_)) | None => {}
        }
    }
    Err(tonic::Status::internal("no final message"))
}

/// A worker of `role` running `engine`, registered with the router at `router`, KV over TCP;
/// it stops when the returned sender is dropped or sent to.
#[allow(dead_code)]
pub async fn spawn_worker(role: ferry_worker::Role, router: &str, engine: ferry_engine::Engine) -> tokio::sync::oneshot::Sender<()> {
    spawn_worker_chunked(role, router, engine, None).await
}

/// [`spawn_worker`] with chunked prefill's per-step budget for a colocated worker.
#[allow(dead_code)]
pub async fn spawn_worker_chunked(role: ferry_worker::Role, router: &str, engine: ferry_engine::Engine, chunk_tokens: Option<usize>) -> tokio::sync::oneshot::Sender<()> {
    let opts = ferry_worker::EngineOptions { chunk_tokens, faults: ferry_worker::fault::FaultInjection::from_env(), ..Default::default() };
    spawn_worker_with(role, router, engine, opts).await
}

/// [`spawn_worker`] with the engine thread's options (chunked prefill, speculation, faults).
#[allow(dead_code)]
pub async fn spawn_worker_with(role: ferry_worker::Role, router: &str, engine: ferry_engine::Engine, opts: ferry_worker::EngineOptions) -> tokio::sync::oneshot::Sender<()> {
    use ferry_worker::{Listeners, Role, TransportChoice, WorkerConfig};
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let data = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let cfg = WorkerConfig { model: "test".into(), router: Some(router.to_string()), transport: TransportChoice::Tcp, ..WorkerConfig::new(role, format!("{role:?}")) };
    let handle = ferry_worker::EngineHandle::start_with(role, engine, "test", opts);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (ready, _) = tokio::sync::watch::channel(false);
    let listeners = Listeners { grpc, data: (role == Role::Decode).then_some(data), metrics: None, health: None };
    tokio::spawn(async move {
        ferry_worker::serve(cfg, handle, listeners, async move { let _ = stopped.await; }, ready).await.expect("worker");
    });
    stop
}

/// A router (`cfg`, heartbeats every 100 ms) with one worker per role of `roles`, each running
/// `engine()`; `each` runs the requests in turn against its address. Everything stops after.
#[allow(dead_code)]
pub async fn run_each<T, Fut: std::future::Future<Output = T>>(
    cfg: RouterConfig,
    roles: &[ferry_worker::Role],
    engine: impl Fn() -> ferry_engine::Engine,
    reqs: &[GenerateRequest],
    each: impl Fn(String, GenerateRequest) -> Fut,
) -> Vec<T> {
    let r = Router::start(RouterConfig { heartbeat: std::time::Duration::from_millis(100), ..cfg }).await;
    let mut workers = Vec::new();
    for &role in roles {
        workers.push(spawn_worker(role, &r.addr, engine()).await);
    }
    let mut out = Vec::new();
    for req in reqs {
        out.push(each(r.addr.clone(), req.clone()).await);
    }
    drop(workers);
    r.stop().await;
    out
}

/// [`generate`], retrying while the router has no ready worker yet (workers registering).
#[allow(dead_code)]
pub async fn generate_when_ready(router: &str, req: GenerateRequest) -> Result<(Vec<u32>, GenerateFinal), tonic::Status> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        match generate(router, req.clone()).await {
            Err(e) if e.code() == tonic::Code::Unavailable && std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await
            }
            r => return r,
        }
    }
}

/// Run `req`, any `n` (retrying while no worker is ready, as [`generate_when_ready`]): each
/// choice's ids and final, by index. Fails if a delta or final names a choice out of range, or
/// a choice ends twice.
#[allow(dead_code)]
pub async fn generate_choices(router: &str, req: GenerateRequest) -> Result<Vec<(Vec<u32>, GenerateFinal)>, tonic::Status> {
    let n = req.sampling.as_ref().map_or(1, |s| s.n.max(1)) as usize;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut s = loop {
        let mut c = FerryClient::connect(format!("http://{router}")).await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        match c.generate(req.clone()).await {
            Err(e) if e.code() == tonic::Code::Unavailable && std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await
            }
            r => break r?.into_inner(),
        }
    };
    let mut out: Vec<(Vec<u32>, Option<GenerateFinal>)> = vec![(Vec::new(), None); n];
    while let Some(m) = s.message().await? {
        match m.event {
            Some(generate_response::Event::Delta(d)) => out.get_mut(d.index as usize).expect("a delta's choice is in range").0.extend(d.token_ids),
            Some(generate_response::Event::Final(f)) => {
                let slot = &mut out.get_mut(f.index as usize).expect("a final's choice is in range").1;
                assert!(slot.is_none(), "choice {} ended twice", f.index);
                *slot = Some(f);
            }
            Some(generate_response::Event::ToolCall(_)) | None => {}
        }
    }
    out.into_iter()
        .enumerate()
        .map(|(i, (ids, f))| f.map(|f| (ids, f)).ok_or_else(|| tonic::Status::internal(format!("no final for choice {i}"))))
        .collect()
}
