//! The gRPC client API (`ferry.v1.Ferry`): a `GenerateRequest` checked and converted here, at
//! the edge, into the pipeline's [`Intake`] (sampling converted and validated once), with tools
//! rendered into the prompt and their calls read back out of the answer ([`super::grpc_tools`]).

use std::sync::Arc;
use std::time::Instant;

use ferry_core::SamplingParams;
use ferry_proto::v1::{self, generate_request::Input};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::RouterError;
use crate::api::grpc_tools;
use crate::api::prompt::{self, PromptError};
use crate::pipeline::start::{Intake, MAX_CACHE_SALT, Started, refused, request_id, request_span, start};
use crate::state::Shared;
use crate::tools::calls::Calls;

#[derive(Clone)]
pub struct FerryService {
    pub shared: Arc<Shared>,
}

/// Checks a `GenerateRequest` and starts it; with tools, its events carry the calls read out of
/// the answer.
pub async fn generate(shared: &Arc<Shared>, req: v1::GenerateRequest, tenant: Option<&ferry_core::Tenant>, parent: ferry_proto::trace::Parent) -> Result<Started, RouterError> {
    let arrived = Instant::now();
    let id = request_id(&req.request_id).map_err(refused)?;
    // The request's root span from here: checking and tokenizing the request count in its time.
    let span = request_span(&id, &parent);
    let (prompt, params, calls) = span.in_scope(|| prepare(shared, &req)).map_err(refused)?;
    let intake = Intake { request_id: id, prompt, params, cache_salt: req.cache_salt, arrived, span };
    let mut started = start(shared, intake, tenant).await?;
    if let Some(calls) = calls {
        started.events = grpc_tools::relay(started.events, calls);
    }
    Ok(started)
}

/// Checks a request and turns it into prompt ids and sampling parameters (its grammar is
/// checked after, by [`crate::pipeline::start::check_grammar`]), and with tools, the scanner its answer's calls are read
/// with ([`grpc_tools`]).
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
    if req.cache_salt.len() > MAX_CACHE_SALT {
        return Err(RouterError::InvalidRequest(format!(
            "cache_salt is {} bytes; at most {}",
            req.cache_salt.len(),
            MAX_CACHE_SALT
        )));
    }
    let asked = grpc_tools::asked(req)?;
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
        Some(Input::Prompt(p)) => prompt::text_ids(text, p)?,
        Some(Input::Chat(c)) if c.messages.is_empty() => {
            return Err(RouterError::InvalidRequest(
                "the chat has no messages".into(),
            ));
        }
        Some(Input::Chat(c)) => {
            let msgs = grpc_tools::messages(c)?;
            let rendered = prompt::chat(shared, &msgs, asked.as_ref()).map_err(|e| match e {
                e @ PromptError::Tools(_) => RouterError::InvalidRequest(e.to_string()),
                PromptError::Other(e) => e,
            })?;
            (tool_grammar, calls) = (rendered.grammar, rendered.calls);
            rendered.ids
        }
        Some(Input::Tokens(t)) => prompt::checked_ids(text, &t.ids)?,
    };
    if req.sampling.as_ref().is_some_and(|s| s.token_offset != 0) {
        return Err(RouterError::InvalidRequest(
            "sampling.token_offset is set by the router when it moves a request between workers; clients leave it 0".into(),
        ));
    }
    let mut params = ferry_proto::checked_sampling(req.sampling.as_ref(), req.stop.as_ref()).map_err(|e| RouterError::InvalidRequest(e.to_string()))?;
    // The tools' grammar is Ferry's own (checked by compiling it, as every grammar is).
    if let Some(lark) = tool_grammar {
        if params.grammar.is_some() {
            return Err(RouterError::InvalidRequest("tool_choice REQUIRED or a named function and sampling.structured both constrain the answer; send one".into()));
        }
        params.grammar = Some(ferry_core::sampling::OutputGrammar::Lark(lark));
    }
    Ok((ids, params, calls))
}

#[tonic::async_trait]
impl v1::ferry_server::Ferry for FerryService {
    type GenerateStream = ReceiverStream<Result<v1::GenerateResponse, Status>>;

    async fn generate(
        &self,
        request: Request<v1::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let tenant = request.extensions().get::<ferry_core::Tenant>().copied();
        let parent = ferry_proto::trace::Parent::from_headers(request.metadata().as_ref());
        let started = generate(&self.shared, request.into_inner(), tenant.as_ref(), parent).await?;
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
