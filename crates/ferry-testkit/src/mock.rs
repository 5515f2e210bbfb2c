//! Mock workers, fast and scriptable, for the router's tests and `ferry bench router` (after
//! sglang's router test mocks). A [`MockWorker`] serves both `Prefill` and `Decode` on its
//! listener and registers with a router in one role, heart-beating (and re-registering after a
//! NOT_FOUND) through the workers' own loop ([`ferry_proto::heartbeat`]). The script is one
//! completion, `first_token` then `tokens`: prefill answers its token at the request's
//! `token_offset` at once (the mock moves no KV); decode answers
//! `admitted`, then the script's ids after that one, a message each, then `final` (so a request
//! migrated after n tokens continues the script where it was).

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry_core::WorkerRole;
use ferry_proto::v1::{self, decode_response::Event};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Response, Status};

use ferry_proto::heartbeat::{self, HeartbeatFloor, LinkEvent, Registrant};
use ferry_router::workers::{DialOptions, endpoint};
use ferry_router::wire::role_to_wire;
use ferry_router::{RouterConfig, RouterError};

/// What a mock worker does.
#[derive(Clone, Debug)]
pub struct MockConfig {
    pub name: String,
    pub model: String,
    pub fingerprint: String,
    pub max_context: u32,
    /// The token prefill answers.
    pub first_token: u32,
    /// The ids decode streams after the first (cut at `max_tokens`).
    pub tokens: Vec<u32>,
    /// Delay before each decode message.
    pub token_delay: Duration,
    /// Decode refuses every request with RESOURCE_EXHAUSTED.
    pub refuse_decode: bool,
    /// Decode breaks every stream after this many token messages (a dying worker's stream).
    pub break_after_tokens: Option<usize>,
    /// Decode goes silent on every stream after this many token messages and stops
    /// heart-beating (a frozen worker: its connections stay open).
    pub freeze_after_tokens: Option<usize>,
    /// Prefill fails every request with this code.
    pub fail_prefill: Option<Code>,
    pub kv_blocks_free: u32,
    pub block_size: u32,
    /// How the mock dials the router: TLS (and its client certificate) or plaintext. The mock
    /// itself always serves plaintext.
    pub router_tls: Option<ferry_proto::tls::ClientTls>,
    /// The KV transports it registers (empty: none listed, as older workers).
    pub kv_transports: Vec<v1::KvTransport>,
    /// The cluster secret: the mock's services require it and it registers with it (open: none).
    pub cluster: ferry_proto::ClusterSecret,
}

impl Default for MockConfig {
    fn default() -> Self {
        MockConfig {
            name: "mock".into(),
            model: "mock".into(),
            fingerprint: "mock-fingerprint".into(),
            max_context: 2048,
            first_token: 28,
            tokens: (29..45).collect(),
            token_delay: Duration::ZERO,
            refuse_decode: false,
            break_after_tokens: None,
            freeze_after_tokens: None,
            fail_prefill: None,
            kv_blocks_free: 1000,
            block_size: 16,
            router_tls: None,
            kv_transports: Vec::new(),
            cluster: Default::default(),
        }
    }
}

impl MockConfig {
    /// The whole scripted completion: the first token, then the rest.
    pub fn script(&self) -> Vec<u32> {
        let mut s = vec![self.first_token];
        s.extend_from_slice(&self.tokens);
        s
    }
}

/// Calls a mock has seen.
#[derive(Debug, Default)]
pub struct MockStats {
    pub prefill_calls: AtomicU64,
    pub decode_calls: AtomicU64,
    /// Decode streams the router dropped before `final`.
    pub decode_cancelled: AtomicU64,
    /// The transfer token of every decode request, then of every prefill request's KV target,
    /// in arrival order.
    pub decode_tokens: std::sync::Mutex<Vec<String>>,
    pub prefill_tokens: std::sync::Mutex<Vec<String>>,
    /// The KV transport each prefill request's target asked for.
    pub prefill_transports: std::sync::Mutex<Vec<v1::KvTransport>>,
    /// The prefix-cache salt of every decode request, in arrival order.
    pub decode_salts: std::sync::Mutex<Vec<Vec<u8>>>,
    /// Set when a stream froze (`freeze_after_tokens`): heartbeats stop.
    pub frozen: std::sync::atomic::AtomicBool,
}

pub struct MockWorker {
    pub role: WorkerRole,
    pub addr: SocketAddr,
    pub stats: Arc<MockStats>,
    id: Arc<Mutex<String>>,
    server: JoinHandle<()>,
    heartbeat: JoinHandle<()>,
}

impl MockWorker {
    /// Serves on `listener`, registers with the router at `router` (returns once registered),
    /// then heartbeats in the background.
    pub async fn start(
        role: WorkerRole,
        listener: TcpListener,
        router: &str,
        cfg: MockConfig,
    ) -> Result<MockWorker, RouterError> {
        let addr = listener.local_addr().map_err(|source| RouterError::Io {
            what: "mock listener address",
            source,
        })?;
        let stats = Arc::new(MockStats::default());
        let svc = MockService {
            cfg: Arc::new(cfg.clone()),
            stats: stats.clone(),
        };
        let guard = cfg.cluster.guard(|_| {});
        let server = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .tcp_nodelay(true)
                .add_service(v1::prefill_server::PrefillServer::with_interceptor(svc.clone(), guard.clone()))
                .add_service(v1::decode_server::DecodeServer::with_interceptor(svc, guard))
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)))
                .await;
        });
        let dial = DialOptions {
            connect_timeout: Duration::from_secs(1),
            tls: cfg.router_tls.clone(),
            cluster: cfg.cluster.clone(),
        };
        let channel = endpoint(router, &dial)?.connect_lazy();
        let mut client = v1::registry_client::RegistryClient::with_interceptor(channel, dial.cluster.bearer());
        let load = v1::WorkerLoad {
            kv_blocks_total: cfg.kv_blocks_free,
            kv_blocks_free: cfg.kv_blocks_free,
            block_size: cfg.block_size,
            ..Default::default()
        };
        let reg = v1::RegisterRequest {
            role: role_to_wire(role) as i32,
            name: cfg.name.clone(),
            grpc_addr: addr.to_string(),
            data_addr: String::new(),
            model: cfg.model.clone(),
            fingerprint: cfg.fingerprint.clone(),
            max_context: cfg.max_context,
            load: Some(load),
            draining: false,
            kv_transports: cfg.kv_transports.iter().map(|&k| k as i32).collect(),
            ..Default::default()
        };
        let r = client
            .register(reg.clone())
            .await
            .map_err(|s| RouterError::BadRegistration(format!("mock register: {s}")))?
            .into_inner();
        let id = Arc::new(Mutex::new(r.worker_id.clone()));
        let mut who = MockRegistrant { reg, id: id.clone(), stats: stats.clone() };
        let router = router.to_string();
        let heartbeat = tokio::spawn(async move {
            heartbeat::keep_registered(client, &router, &mut who, Some(r), HeartbeatFloor(Duration::from_millis(1))).await;
        });
        Ok(MockWorker {
            role,
            addr,
            stats,
            id,
            server,
            heartbeat,
        })
    }

    /// The id the router gave at the latest registration.
    pub fn id(&self) -> String {
        self.id.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Stops heart-beating (the lease will expire); the server keeps answering.
    pub fn stop_heartbeats(&self) {
        self.heartbeat.abort();
    }
}

impl Drop for MockWorker {
    fn drop(&mut self) {
        self.heartbeat.abort();
        self.server.abort();
    }
}

/// The mock as its router sees it: a fixed load, never draining, silent once frozen.
struct MockRegistrant {
    reg: v1::RegisterRequest,
    id: Arc<Mutex<String>>,
    stats: Arc<MockStats>,
}

impl Registrant for MockRegistrant {
    fn register_request(&mut self) -> v1::RegisterRequest {
        self.reg.clone()
    }

    fn heartbeat_request(&mut self, worker_id: &str) -> v1::HeartbeatRequest {
        v1::HeartbeatRequest {
            worker_id: worker_id.to_string(),
            load: self.reg.load,
            draining: false,
            grpc_addr: self.reg.grpc_addr.clone(),
            ..Default::default()
        }
    }

    fn observe(&mut self, event: LinkEvent<'_>) {
        match event {
            LinkEvent::Registered(r) => *self.id.lock().unwrap_or_else(|p| p.into_inner()) = r.worker_id.clone(),
            // The mock keeps no readiness of its own, and keeps its id until it registers again.
            LinkEvent::Answered(_) | LinkEvent::Forgotten | LinkEvent::Unanswered | LinkEvent::Lease(_) => {}
        }
    }

    async fn next_beat(&mut self, every: Duration) -> bool {
        tokio::time::sleep(every).await;
        !self.stats.frozen.load(Ordering::Relaxed)
    }
}

fn record<T>(seen: &std::sync::Mutex<Vec<T>>, token: T) {
    seen.lock().unwrap_or_else(|p| p.into_inner()).push(token);
}

#[derive(Clone)]
struct MockService {
    cfg: Arc<MockConfig>,
    stats: Arc<MockStats>,
}

#[tonic::async_trait]
impl v1::prefill_server::Prefill for MockService {
    async fn prefill(
        &self,
        req: Request<v1::PrefillRequest>,
    ) -> Result<Response<v1::PrefillResponse>, Status> {
        self.stats.prefill_calls.fetch_add(1, Ordering::Relaxed);
        let token = req.get_ref().target.as_ref().map(|t| t.transfer_token.clone());
        record(&self.stats.prefill_tokens, token.unwrap_or_default());
        let asked = req.get_ref().target.as_ref().map_or(0, |t| t.transport);
        let asked = v1::KvTransport::try_from(asked).unwrap_or(v1::KvTransport::Unspecified);
        self.stats.prefill_transports.lock().unwrap_or_else(|p| p.into_inner()).push(asked);
        if let Some(code) = self.cfg.fail_prefill {
            return Err(Status::new(code, "mock prefill failure"));
        }
        // The mock moves no KV; it reports the transport it was asked for, as a worker that could
        // set it up would.
        let used = if asked == v1::KvTransport::Unspecified { v1::KvTransport::Grpc } else { asked };
        let kv = v1::KvTransferStats {
            transport: used as i32,
            bytes: 4096,
            chunks: 1,
            duration_ms: 0.05,
            exposed_ms: 0.0,
        };
        if req.get_ref().sampling.as_ref().is_some_and(|s| s.n > 1) {
            return Err(Status::invalid_argument("mock: one choice per request (sampling.n > 1 is not mocked)"));
        }
        let offset = req.get_ref().sampling.as_ref().map_or(0, |s| s.token_offset) as usize;
        let first_token = self.cfg.script().get(offset).copied().unwrap_or(self.cfg.first_token);
        let sampling = req.get_ref().sampling.as_ref();
        let prompt = &req.get_ref().prompt;
        Ok(Response::new(v1::PrefillResponse {
            first_token,
            first_is_stop: false,
            queue_ms: 0.0,
            prefill_ms: 0.0,
            kv: Some(kv),
            first_logprob: mock_logprob(sampling.and_then(|s| s.logprobs), first_token),
            prompt_logprobs: prompt.iter().skip(1).filter_map(|&t| mock_logprob(sampling.and_then(|s| s.prompt_logprobs), t)).collect(),
            ..Default::default()
        }))
    }
}

#[tonic::async_trait]
impl v1::decode_server::Decode for MockService {
    type DecodeStream = ReceiverStream<Result<v1::DecodeResponse, Status>>;

    async fn decode(
        &self,
        req: Request<v1::DecodeRequest>,
    ) -> Result<Response<Self::DecodeStream>, Status> {
        self.stats.decode_calls.fetch_add(1, Ordering::Relaxed);
        record(&self.stats.decode_tokens, req.get_ref().transfer_token.clone());
        record(&self.stats.decode_salts, req.get_ref().cache_salt.to_vec());
        if self.cfg.refuse_decode {
            let mut s = Status::resource_exhausted("mock: no room in the KV cache");
            s.metadata_mut().insert(
                ferry_core::failure::FAULT_KEY,
                tonic::metadata::MetadataValue::from_static(ferry_core::failure::WorkerFault::Overloaded.as_str()),
            );
            return Err(s);
        }
        let offset = req.get_ref().sampling.as_ref().map_or(0, |s| s.token_offset) as usize;
        let logprobs = req.get_ref().sampling.as_ref().and_then(|s| s.logprobs);
        let max = req.get_ref().stop.as_ref().map_or(0, |s| s.max_tokens);
        let max = if max == 0 {
            ferry_proto::DEFAULT_MAX_TOKENS
        } else {
            max as usize
        };
        let (tx, rx) = mpsc::channel(16);
        let (cfg, stats) = (self.cfg.clone(), self.stats.clone());
        tokio::spawn(async move {
            let msg = |event| Ok(v1::DecodeResponse { event: Some(event) });
            let admitted = v1::Admitted {
                transfer_id: rand::random(),
                data_addr: String::new(),
                ..Default::default()
            };
            if tx.send(msg(Event::Admitted(admitted))).await.is_err() {
                return;
            }
            let mut sent = 1;
            let script = cfg.script();
            let rest = script.get(offset + 1..).unwrap_or_default();
            for (i, &id) in rest.iter().take(max.saturating_sub(1)).enumerate() {
                if !cfg.token_delay.is_zero() {
                    tokio::time::sleep(cfg.token_delay).await;
                }
                if cfg.break_after_tokens == Some(i) {
                    let _ = tx.send(Err(Status::unknown("mock: h2 stream broken"))).await;
                    return;
                }
                if cfg.freeze_after_tokens == Some(i) {
                    stats.frozen.store(true, Ordering::Relaxed);
                    // Silent, with the stream open, until the router gives up on it.
                    tx.closed().await;
                    stats.decode_cancelled.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                if tx
                    .send(msg(Event::Tokens(v1::DecodeTokens {
                        ids: vec![id],
                        logprobs: mock_logprob(logprobs, id).into_iter().collect(),
                        choice: 0,
                    })))
                    .await
                    .is_err()
                {
                    stats.decode_cancelled.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                sent += 1;
            }
            let finish = if sent >= max {
                v1::FinishReason::Length
            } else {
                v1::FinishReason::StopToken
            };
            let fin = v1::DecodeFinal {
                finish_reason: finish as i32,
                completion_tokens: sent as u32,
                kv_wait_ms: 0.0,
                decode_ms: 0.0,
                choice: 0,
                ..Default::default()
            };
            if tx.send(msg(Event::Final(fin))).await.is_err() {
                stats.decode_cancelled.fetch_add(1, Ordering::Relaxed);
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// What the router adds to a request's latency, from `router_overhead`.
#[derive(Clone, Debug, PartialEq)]
pub struct OverheadStats {
    pub requests: usize,
    pub tokens_per_request: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub mean_ms: f64,
    pub max_ms: f64,
}

/// Runs a router and a pair of zero-delay mock workers in this process on 127.0.0.1:0, sends
/// `n_requests` requests one after another, and reports the client-observed end-to-end latency
/// minus the mocks' own (scripted) time: the router's added latency, loopback hops included.
pub async fn router_overhead(
    model: &Path,
    n_requests: usize,
) -> Result<OverheadStats, RouterError> {
    let io = |what| move |source| RouterError::Io { what, source };
    let text =
        ferry_tokenizer::ModelText::open(model).map_err(|source| RouterError::LoadModel {
            path: model.into(),
            source,
        })?;
    let ids = text
        .encode_prompt(" The quick brown fox jumps over the lazy dog.")
        .map_err(RouterError::Tokenize)?;
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(io("binding the router"))?;
    let router_addr = listener
        .local_addr()
        .map_err(io("router address"))?
        .to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let router = tokio::spawn(ferry_router::serve(
        RouterConfig::new(model),
        ferry_router::Listeners::grpc(listener),
        async move {
            let _ = stopped.await;
        },
    ));
    let cfg = MockConfig {
        first_token: ids[0],
        tokens: ids[1..].to_vec(),
        ..Default::default()
    };
    let mut workers = Vec::new();
    for role in [WorkerRole::Prefill, WorkerRole::Decode] {
        let l = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(io("binding a mock worker"))?;
        workers.push(MockWorker::start(role, l, &router_addr, cfg.clone()).await?);
    }
    let dial = DialOptions {
        connect_timeout: Duration::from_secs(1),
        tls: None,
        cluster: Default::default(),
    };
    let channel = endpoint(&router_addr, &dial)?
        .connect()
        .await
        .map_err(|e| RouterError::BadAddress {
            addr: router_addr.clone(),
            message: e.to_string(),
        })?;
    let mut client = v1::ferry_client::FerryClient::new(channel);
    let req = v1::GenerateRequest {
        input: Some(v1::generate_request::Input::Prompt("Hello".into())),
        stop: Some(v1::StopConditions {
            max_tokens: ids.len() as u32,
            ..Default::default()
        }),
        ..Default::default()
    };
    let warmup = 20.min(n_requests.max(1));
    let mut samples = Vec::with_capacity(n_requests);
    for i in 0..warmup + n_requests {
        let t = Instant::now();
        let mut stream = client
            .generate(req.clone())
            .await
            .map_err(|s| RouterError::Protocol {
                worker: "router".into(),
                request_id: String::new(),
                message: s.to_string(),
            })?
            .into_inner();
        while let Some(m) = stream.message().await.map_err(|s| RouterError::Protocol {
            worker: "router".into(),
            request_id: String::new(),
            message: s.to_string(),
        })? {
            if matches!(m.event, Some(v1::generate_response::Event::Final(_))) {
                break;
            }
        }
        let mock_time = cfg.token_delay * ids.len().saturating_sub(1) as u32;
        if i >= warmup {
            samples.push(t.elapsed().saturating_sub(mock_time).as_secs_f64() * 1e3);
        }
    }
    drop(workers);
    let _ = stop.send(());
    let _ = router.await;
    samples.sort_by(f64::total_cmp);
    let pct = |p: f64| {
        samples
            .get(((samples.len() as f64 - 1.0) * p).round() as usize)
            .copied()
            .unwrap_or(0.0)
    };
    Ok(OverheadStats {
        requests: samples.len(),
        tokens_per_request: ids.len(),
        p50_ms: pct(0.5),
        p99_ms: pct(0.99),
        mean_ms: samples.iter().sum::<f64>() / samples.len().max(1) as f64,
        max_ms: samples.last().copied().unwrap_or(0.0),
    })
}

/// A made-up logprob for `id` when `top` alternatives were asked for: `-id/1000`, with the
/// alternatives `id, id + 1, ...` (so tests can tell which token an entry belongs to).
pub fn mock_logprob(top: Option<u32>, id: u32) -> Option<v1::TokenLogprob> {
    let lp = |t: u32| -(t as f32) / 1000.0;
    top.map(|n| v1::TokenLogprob {
        token_id: id,
        logprob: lp(id),
        top: (id..id + n).map(|t| v1::TopLogprob { token_id: t, logprob: lp(t) }).collect(),
    })
}
