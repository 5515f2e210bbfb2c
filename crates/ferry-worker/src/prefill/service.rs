//! The gRPC `Prefill` service: checks a request, queues its prompt on the engine thread
//! ([`super::engine_thread`]), and pushes its KV to the decode worker over the transport
//! [`choose`] picks, answering once the decode worker acknowledged it.

use super::admission::PrefillJob;
use super::handle::PrefillHandle;
use super::transport_choice::{choose, Choice, Host, Situation};
use crate::cluster::drain::Drain;
use crate::error::{Result, WorkerError};
use crate::kv::send::{push, Fallback, KvTransport};
use crate::pick::rules_for;
use crate::role::TransportChoice;
use ferry_core::kv_payload::KvPayloadHeader;
use ferry_core::KvSpan;
use ferry_proto::v1::{KvBegin, KvTarget, KvTransport as KvTransportKind, PrefillRequest, PrefillResponse};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};
use tracing::Instrument;

/// The gRPC `Prefill` service.
pub struct PrefillService {
    pub engine: PrefillHandle,
    pub tcp: Arc<dyn KvTransport>,
    pub grpc: Arc<dyn KvTransport>,
    /// Device-to-device pipes (NCCL or CUDA IPC), when this worker has them.
    pub pipe: Option<Arc<dyn KvTransport>>,
    /// This worker's own preference, for requests whose target names no transport.
    pub prefer: TransportChoice,
    /// The plaintext TCP data path may be used (not with TLS).
    pub allow_tcp: bool,
    /// Longest a transfer step may make no progress (see [`crate::kv::DEFAULT_STALL`]).
    pub stall: std::time::Duration,
    pub name: String,
    /// Held from the request's arrival until the decode worker acknowledged its KV.
    pub drain: Arc<Drain>,
}

/// Sets the job's cancel flag when the RPC is dropped (client gone) before it finished.
struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Relaxed);
    }
}

impl PrefillService {
    /// The transport for one transfer ([`choose`]): the router's choice for the pair (the
    /// target's `transport`), else this worker's preference, with its fallbacks.
    fn transport_for(&self, target: &KvTarget) -> Arc<dyn KvTransport> {
        let situation = Situation {
            requested: KvTransportKind::try_from(target.transport).unwrap_or(KvTransportKind::Unspecified),
            prefer: self.prefer,
            allow_tcp: self.allow_tcp,
            data_addr: !target.data_addr.is_empty(),
            pipe: self.pipe.as_ref().map(|p| p.kind()),
        };
        let host = |h: Host| match h {
            Host::Tcp => self.tcp.clone(),
            Host::Grpc => self.grpc.clone(),
        };
        match (choose(&situation), &self.pipe) {
            (Choice::Host(h), _) => host(h),
            (Choice::Pipe { then }, Some(pipe)) => Arc::new(Fallback { first: pipe.clone(), then: host(then) }),
            (Choice::Pipe { then }, None) => host(then),
            (Choice::MissingPipe { wanted, host: h }, _) => {
                let h = host(h);
                metrics::counter!(crate::cluster::metrics::names::KV_TRANSPORT_FALLBACKS, "from" => wanted.to_string(), "to" => h.kind().to_string()).increment(1);
                tracing::debug!("KV over {wanted} requested, but this worker has no such pipes: using {}", h.kind());
                h
            }
        }
    }

    async fn run(&self, req: PrefillRequest) -> Result<PrefillResponse> {
        // Held until `push` returns, i.e. after the decode worker's acknowledgement: a draining
        // prefill worker exits only when every KV it produced has been taken.
        let _work = self.drain.begin()?;
        let facts = &self.engine.facts;
        facts.check_prompt(&req.prompt)?;
        let params = ferry_proto::checked_sampling(req.sampling.as_ref(), req.stop.as_ref())?;
        let rules = rules_for(facts, &params, &req.prompt).await?;
        let target: KvTarget = req.target.clone().ok_or_else(|| WorkerError::InvalidRequest("no KV target".into()))?;
        let transport = self.transport_for(&target);
        let (out, mut rx) = mpsc::unbounded_channel();
        let cancelled = Arc::new(AtomicBool::new(false));
        let _cancel = CancelOnDrop(cancelled.clone());
        let tokens = req.prompt.len();
        // The decode worker holds the prompt's first `ship_from` tokens: ship the rest.
        let ship_from = target.start_block as usize * facts.layout.block_size;
        if ship_from >= tokens {
            return Err(WorkerError::InvalidRequest(format!(
                "the KV target starts at block {} (token {ship_from}) of a {tokens}-token prompt: nothing would be shipped",
                target.start_block
            )));
        }
        let buffers = matches!(transport.kind(), KvTransportKind::Nccl | KvTransportKind::CudaIpc);
        let cached = Arc::new(AtomicUsize::new(0));
        let salt = req.cache_salt.to_vec();
        // The engine thread times each chunk of the prompt under the request's span.
        let span = tracing::Span::current();
        let job = PrefillJob { request_id: req.request_id.clone(), prompt: req.prompt, params, out, cancelled, enqueued: Instant::now(), buffers, salt, ship_from, cached: cached.clone(), rules, span };
        self.engine.submit(job)?;
        let span = KvSpan { header: KvPayloadHeader { layout: facts.layout, tokens: tokens - ship_from }, start: ship_from };
        let send = tracing::info_span!("kv_send", transport = tracing::field::Empty, bytes = tracing::field::Empty, decode = %target.decode_worker);
        let begin = KvBegin {
            transfer_token: target.transfer_token.clone(),
            fingerprint: facts.fingerprint.clone(),
            header: span.encode().into(),
            request_id: req.request_id.clone(),
            traceparent: ferry_proto::trace::traceparent(&send),
        };
        let pushed = push(transport.as_ref(), &target, begin, &mut rx, self.stall).instrument(send.clone()).await?;
        let kind = KvTransportKind::try_from(pushed.stats.transport).unwrap_or(KvTransportKind::Unspecified).to_string();
        send.record("transport", kind.as_str()).record("bytes", pushed.stats.bytes);
        drop(send);
        metrics::counter!(crate::cluster::metrics::names::KV_TRANSFERS, "transport" => kind.clone()).increment(1);
        metrics::counter!(crate::cluster::metrics::names::KV_TRANSFER_BYTES, "transport" => kind.clone()).increment(pushed.stats.bytes);
        metrics::histogram!(crate::cluster::metrics::names::KV_TRANSFER_SECONDS, "transport" => kind).record(pushed.stats.duration_ms / 1e3);
        metrics::histogram!(crate::cluster::metrics::names::PREFILL_SECONDS).record(pushed.computed.as_secs_f64());
        metrics::histogram!(crate::cluster::metrics::names::REQUEST_QUEUE_TIME, "role" => "prefill").record(pushed.queued.as_secs_f64());
        let cached = cached.load(Relaxed);
        tracing::info!(
            request_id = %req.request_id, tokens, cached, ship_from, kv_bytes = pushed.stats.bytes, transfer_ms = pushed.stats.duration_ms,
            exposed_ms = pushed.stats.exposed_ms, decode = %target.decode_worker, "prefilled"
        );
        Ok(PrefillResponse {
            first_token: pushed.first_token,
            first_is_stop: pushed.first_is_stop,
            queue_ms: pushed.queued.as_secs_f64() * 1e3,
            prefill_ms: pushed.computed.as_secs_f64() * 1e3,
            kv: Some(pushed.stats),
            cached_tokens: cached as u32,
            first_logprob: pushed.first_logprob.as_ref().map(ferry_proto::logprob_to_wire),
            prompt_logprobs: pushed.prompt_logprobs.iter().map(ferry_proto::logprob_to_wire).collect(),
            more_choices: pushed.more_choices,
        })
    }
}

#[tonic::async_trait]
impl ferry_proto::v1::prefill_server::Prefill for PrefillService {
    async fn prefill(&self, req: Request<PrefillRequest>) -> std::result::Result<Response<PrefillResponse>, Status> {
        // Its children: each chunk the engine computes (`prefill_chunk`) and the KV's transfer (`kv_send`).
        let span = tracing::info_span!("prefill", request_id = %req.get_ref().request_id, worker = %self.name, prompt_tokens = req.get_ref().prompt.len());
        ferry_proto::trace::Parent::from_headers(req.metadata().as_ref()).adopt(&span);
        let req = req.into_inner();
        let id = req.request_id.clone();
        match self.run(req).instrument(span).await {
            Ok(r) => {
                metrics::counter!(crate::cluster::metrics::names::REQUESTS, "role" => "prefill", "outcome" => "ok").increment(1);
                Ok(Response::new(r))
            }
            Err(e) => {
                metrics::counter!(crate::cluster::metrics::names::REQUESTS, "role" => "prefill", "outcome" => "error").increment(1);
                tracing::warn!(request_id = %id, worker = %self.name, "prefill failed: {e}");
                Err(e.into())
            }
        }
    }
}
