//! The client API (`ferry.v1.Ferry`): request validation and tokenization here, then each
//! generation runs in its own task ([`crate::orchestrate`]) feeding the response stream.

use std::sync::Arc;
use std::time::Instant;

use ferry_core::SamplingParams;
use ferry_proto::v1::{self, generate_request::Input};
use ferry_tokenizer::{ChatMessage, ModelText};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::orchestrate::{self, Job};
use crate::tools::calls::Calls;
use crate::registry::Registry;
use crate::{RouterConfig, RouterError};

/// State shared by the router's services.
pub struct Shared {
    pub registry: Arc<Registry>,
    /// Requests waiting for room on a decode worker.
    pub queue: Arc<crate::queue::AdmissionQueue>,
    /// The model's tokenizer and chat template; `text.name` is the served name clients see.
    pub text: ModelText,
    pub cfg: RouterConfig,
    /// Structured outputs: grammars are compiled here first, so a bad one is refused before any
    /// worker sees it.
    pub grammars: ferry_grammar::LazyGrammars,
    /// What the autoscaler measures: arrivals and finished requests since it last looked.
    pub window: crate::autoscale::Window,
}

impl Shared {
    /// Every name the model is served under, the reported one first.
    pub fn model_names(&self) -> Vec<&str> {
        let mut names = vec![self.text.name.as_str()];
        names.extend(self.cfg.served_model_names.iter().skip(1).map(String::as_str));
        names
    }

    /// Whether a request's `model` names this router's model.
    pub fn serves(&self, model: &str) -> bool {
        self.model_names().contains(&model)
    }
}

#[derive(Clone)]
pub struct FerryService {
    pub shared: Arc<Shared>,
}

/// The client's request id, or a fresh random one.
pub fn request_id(given: &str) -> String {
    if given.is_empty() {
        format!("{:016x}", rand::random::<u64>())
    } else {
        given.to_owned()
    }
}

/// Checks a request and turns it into prompt ids and sampling parameters (its grammar is
/// checked after, by [`check_grammar`]), and with tools, the scanner its answer's calls are read
/// with ([`crate::grpc_tools`]).
pub fn prepare(
    shared: &Shared,
    req: &v1::GenerateRequest,
) -> Result<(Vec<u32>, SamplingParams, Option<Calls>), RouterError> {
    let text = &shared.text;
    if !req.model.is_empty() && !shared.serves(&req.model) {
        return Err(RouterError::UnknownModel {
            requested: crate::error::clip(&req.model).into_owned(),
            served: shared.model_names().join(", "),
        });
    }
    if req.cache_salt.len() > crate::openai::request::MAX_CACHE_SALT {
        return Err(RouterError::InvalidRequest(format!(
            "cache_salt is {} bytes; at most {}",
            req.cache_salt.len(),
            crate::openai::request::MAX_CACHE_SALT
        )));
    }
    let asked = crate::grpc_tools::asked(req)?;
    if asked.is_some() && !matches!(req.input, Some(Input::Chat(_))) {
        return Err(RouterError::InvalidRequest("tools need chat input (`chat`): the tools are rendered with the conversation".into()));
    }
    let (mut tool_grammar, mut calls) = (None, None);
    let ids = match &req.input {
        None => {
            return Err(RouterError::InvalidRequest(
                "no input: set prompt, chat or tokens".into(),
            ));
        }
        Some(Input::Prompt(p)) if p.is_empty() => {
            return Err(RouterError::InvalidRequest("the prompt is empty".into()));
        }
        Some(Input::Prompt(p)) => text.encode_prompt(p).map_err(RouterError::Tokenize)?,
        Some(Input::Chat(c)) if c.messages.is_empty() => {
            return Err(RouterError::InvalidRequest(
                "the chat has no messages".into(),
            ));
        }
        Some(Input::Chat(c)) => {
            let msgs = crate::grpc_tools::messages(c)?;
            let rendered = crate::prompt::chat(shared, &msgs, asked.as_ref()).map_err(|e| match e {
                e @ crate::prompt::PromptError::Tools(_) => RouterError::InvalidRequest(e.to_string()),
                crate::prompt::PromptError::Other(e) => e,
            })?;
            (tool_grammar, calls) = (rendered.grammar, rendered.calls);
            rendered.ids
        }
        Some(Input::Tokens(t)) => {
            let vocab = text.tokenizer.vocab_size();
            if let Some(&bad) = t.ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(RouterError::InvalidRequest(format!(
                    "token id {bad} is outside the vocabulary (size {vocab})"
                )));
            }
            t.ids.clone()
        }
    };
    if ids.is_empty() {
        return Err(RouterError::InvalidRequest(
            "the prompt has no tokens".into(),
        ));
    }
    if let Some(ctx) = shared.registry.max_context()
        && ids.len() >= ctx as usize
    {
        return Err(RouterError::InvalidRequest(format!(
            "the prompt has {} tokens but the context is {ctx}",
            ids.len()
        )));
    }
    if req.sampling.as_ref().is_some_and(|s| s.token_offset != 0) {
        return Err(RouterError::InvalidRequest(
            "sampling.token_offset is set by the router when it moves a request between workers; clients leave it 0".into(),
        ));
    }
    let mut params = ferry_proto::sampling_from_wire(req.sampling.as_ref(), req.stop.as_ref());
    if let Some(lark) = tool_grammar {
        if params.grammar.is_some() {
            return Err(RouterError::InvalidRequest("tool_choice REQUIRED or a named function and sampling.structured both constrain the answer; send one".into()));
        }
        params.grammar = Some(ferry_core::sampling::OutputGrammar::Lark(lark));
    }
    params
        .validate()
        .map_err(|e| RouterError::InvalidRequest(e.to_string()))?;
    Ok((ids, params, calls))
}

/// Compiles a request's grammar as a worker would (limits, compile, first mask), on the grammar
/// pool's threads, never this runtime's (issue 32). A full pool is a retryable refusal.
pub async fn check_grammar(shared: &Shared, grammar: &ferry_core::sampling::OutputGrammar) -> Result<(), RouterError> {
    use ferry_grammar::GrammarError as G;
    shared.grammars.check(grammar).await.map_err(|e| match e {
        G::Busy { waited_ms } => RouterError::GrammarBusy { waited_ms, retry_after_s: 1 },
        e @ (G::Tokenizer(_) | G::Invalid { .. } | G::Limit { .. } | G::Timeout { .. } | G::Panicked { .. } | G::Threads(_) | G::Matcher(_)) => {
            RouterError::InvalidGrammar(e)
        }
    })
}

/// A conversation rendered with the model's chat template, offering `tools` when given; with
/// `add_generation_prompt`, it ends with the assistant's header.
pub fn render_chat(
    text: &ModelText,
    messages: &[ChatMessage],
    tools: Option<&[serde_json::Value]>,
    add_generation_prompt: bool,
) -> Result<String, RouterError> {
    let tpl = text.chat_template.as_ref().ok_or_else(|| {
        RouterError::InvalidRequest(format!("model {} has no chat template", text.name))
    })?;
    tpl.render_with_tools(messages, tools, add_generation_prompt)
        .map_err(|e| RouterError::InvalidRequest(format!("chat template: {e}")))
}

/// A chat's prompt ids: the conversation rendered (as [`render_chat`], ending with the
/// assistant's header) and encoded without added special tokens (the template writes them
/// itself), what clients wrote tokenized as plain text ([`ferry_tokenizer::ChatTemplate::encode`]:
/// a `<|im_end|>` inside a message is characters, not the special token).
pub fn chat_ids(
    text: &ModelText,
    messages: &[ChatMessage],
    tools: Option<&[serde_json::Value]>,
) -> Result<Vec<u32>, RouterError> {
    encode_chat(text, messages, tools, true, false)
}

/// [`chat_ids`] with the choices `/tokenize` offers.
pub fn encode_chat(
    text: &ModelText,
    messages: &[ChatMessage],
    tools: Option<&[serde_json::Value]>,
    add_generation_prompt: bool,
    add_special_tokens: bool,
) -> Result<Vec<u32>, RouterError> {
    let tpl = text.chat_template.as_ref().ok_or_else(|| {
        RouterError::InvalidRequest(format!("model {} has no chat template", text.name))
    })?;
    tpl.encode(&text.tokenizer, messages, tools, add_generation_prompt, add_special_tokens)
        .map_err(|e| match e {
            e @ ferry_tokenizer::TokenizerError::TemplateRender(_) => RouterError::InvalidRequest(format!("chat template: {e}")),
            e => RouterError::Tokenize(e),
        })
}

/// A request that passed validation and now runs in its own task.
pub struct Started {
    pub request_id: String,
    pub prompt_tokens: usize,
    /// The prompt's token ids (an `echo` answer names them).
    pub prompt: Vec<u32>,
    /// Deltas, then one final message or one error status. Dropping it cancels the request.
    pub events: mpsc::Receiver<Result<v1::GenerateResponse, Status>>,
}

/// The one entry point of the client APIs (gRPC and HTTP): validates and tokenizes `req`, checks
/// that workers are ready, and spawns [`orchestrate::run`] for it. Refusals are counted in the
/// request metrics.
/// `tenant`: the API key's tenant, when keys are on (its prompts share cached KV only with each
/// other).
pub async fn start(shared: &Arc<Shared>, req: v1::GenerateRequest, tenant: Option<&ferry_core::Tenant>) -> Result<Started, RouterError> {
    let start = Instant::now();
    // Checked before anything logs it or a span carries it.
    ferry_proto::request_id::check(&req.request_id).map_err(|e| {
        crate::metrics::request_outcome("invalid");
        RouterError::InvalidRequest(e.to_string())
    })?;
    let id = request_id(&req.request_id);
    let span = tracing::info_span!("generate", request_id = %id);
    let (prompt, params, calls) = span.in_scope(|| prepare(shared, &req)).inspect_err(|_| {
        crate::metrics::request_outcome("invalid");
    })?;
    if let Some(g) = &params.grammar {
        check_grammar(shared, g).instrument(span.clone()).await.inspect_err(|_| crate::metrics::request_outcome("invalid"))?;
    }
    let ready = shared.registry.ready();
    if !ready.can_serve() {
        crate::metrics::request_outcome("unavailable");
        let role = if ready.prefill == 0 {
            ferry_core::WorkerRole::Prefill
        } else {
            ferry_core::WorkerRole::Decode
        };
        return Err(RouterError::NoWorker { role });
    }
    let (tx, rx) = mpsc::channel(64);
    let prompt_tokens = prompt.len();
    let job = Job {
        request_id: id.clone(),
        prompt: prompt.clone(),
        params,
        cache_salt: ferry_core::prefix_cache::cache_salt(tenant, req.cache_salt.as_bytes()),
        start,
    };
    tokio::spawn(orchestrate::run(shared.clone(), job, tx).instrument(span));
    let events = match calls {
        Some(calls) => crate::grpc_tools::relay(rx, calls),
        None => rx,
    };
    Ok(Started {
        request_id: id,
        prompt_tokens,
        prompt,
        events,
    })
}

#[tonic::async_trait]
impl v1::ferry_server::Ferry for FerryService {
    type GenerateStream = ReceiverStream<Result<v1::GenerateResponse, Status>>;

    async fn generate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let tenant = request.extensions().get::<ferry_core::Tenant>().copied();
        let started = start(&self.shared, request.into_inner(), tenant.as_ref()).await?;
        Ok(Response::new(ReceiverStream::new(started.events)))
    }

    async fn health(
        &self,
        _: Request<v1::HealthRequest>,
    ) -> Result<Response<v1::HealthResponse>, Status> {
        let ready = self.shared.registry.ready();
        Ok(Response::new(v1::HealthResponse {
            serving: ready.can_serve(),
            prefill_workers: ready.prefill,
            decode_workers: ready.decode,
            colocated_workers: ready.colocated,
        }))
    }

    async fn model_info(
        &self,
        _: Request<v1::ModelInfoRequest>,
    ) -> Result<Response<v1::ModelInfoResponse>, Status> {
        let s = &self.shared;
        Ok(Response::new(v1::ModelInfoResponse {
            model: s.text.name.clone(),
            fingerprint: s.registry.fingerprint().unwrap_or_default(),
            max_context: s.registry.max_context().unwrap_or(0),
            vocab_size: s.text.tokenizer.vocab_size() as u32,
            eos_token_ids: s.text.eos_ids.clone(),
            has_chat_template: s.text.chat_template.is_some(),
        }))
    }
}
