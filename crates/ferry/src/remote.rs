//! `ferry generate --router ADDR`: the same prompt, chat and sampling options as local generate,
//! sent to a router; text streams to stdout, then the stats line (as local generate prints it,
//! plus the workers and the KV transfer) to stderr.

use std::io::Write;

use ferry_core::SamplingParams;
use ferry_proto::v1;

/// One remote generation.
#[derive(Clone, Debug)]
pub struct RemoteGenerate {
    /// The router's gRPC address (`host:port` or `http://host:port`).
    pub router: String,
    pub prompt: String,
    /// Send the prompt as a chat (the router applies the model's chat template).
    pub chat: bool,
    /// System message for `chat`.
    pub system: Option<String>,
    pub params: SamplingParams,
    /// Sent as `authorization: Bearer KEY` when the router requires API keys.
    pub api_key: Option<String>,
    /// TLS to the router (None: plaintext).
    pub tls: Option<ferry_proto::tls::ClientTls>,
}

pub use ferry_proto::Bearer;

/// A client of the router's `Ferry` API that sends the API key, if any.
pub type Client = v1::ferry_client::FerryClient<tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Bearer>>;

pub fn client(channel: tonic::transport::Channel, bearer: Bearer) -> Client {
    v1::ferry_client::FerryClient::with_interceptor(channel, bearer)
}

/// Streams the generation to stdout and prints the stats line; gRPC errors come back as
/// `<code>: <message>`.
pub fn generate_remote(req: &RemoteGenerate) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    let fin = generate_to(req, &mut out)?;
    drop(out);
    println!();
    eprintln!("{}", stats_line(&fin));
    Ok(())
}

/// The gRPC status as `<code>: <message>` (main prints it after `error: `).
pub fn status_error(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{:?}: {}", s.code(), s.message())
}

/// Runs the request, writing text to `out` as it arrives; returns the final message.
pub fn generate_to(req: &RemoteGenerate, out: &mut dyn Write) -> anyhow::Result<v1::GenerateFinal> {
    req.params.validate()?;
    let (sampling, stop) = ferry_proto::sampling_to_wire(&req.params);
    let input = if req.chat {
        let mut messages = Vec::new();
        if let Some(s) = &req.system {
            messages.push(v1::ChatMessage { role: "system".into(), content: s.clone(), ..Default::default() });
        }
        messages.push(v1::ChatMessage { role: "user".into(), content: req.prompt.clone(), ..Default::default() });
        v1::generate_request::Input::Chat(v1::ChatInput { messages })
    } else {
        v1::generate_request::Input::Prompt(req.prompt.clone())
    };
    let request = v1::GenerateRequest { input: Some(input), sampling: Some(sampling), stop: Some(stop), ..Default::default() };
    let bearer = Bearer::new(req.api_key.as_deref()).map_err(|e| anyhow::anyhow!("the API key: {e}"))?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async move {
        let channel = connect(&req.router, req.tls.as_ref()).await?;
        let mut client = client(channel, bearer);
        // A plaintext client to a TLS port connects (lazily) and fails on the first call.
        let hint = |s: tonic::Status| match s.code() {
            tonic::Code::Unknown | tonic::Code::Internal | tonic::Code::Unavailable | tonic::Code::Cancelled => {
                anyhow::anyhow!("{:?}: {} ({})", s.code(), ferry_proto::tls::error_chain(&s), ferry_proto::tls::connect_hint(req.tls.as_ref()))
            }
            _ => status_error(s),
        };
        let mut stream = client.generate(request).await.map_err(hint)?.into_inner();
        while let Some(m) = stream.message().await.map_err(status_error)? {
            match m.event {
                Some(v1::generate_response::Event::Delta(d)) => {
                    out.write_all(d.text.as_bytes())?;
                    out.flush()?;
                }
                Some(v1::generate_response::Event::Final(f)) => return Ok(f),
                // `ferry generate --router` sends no tools.
                Some(v1::generate_response::Event::ToolCall(_)) | None => {}
            }
        }
        anyhow::bail!("Unavailable: the router closed the stream without a final message")
    })
}

/// A connection to the router at `router` (TLS when `tls` is given); a failure says why, with
/// the TLS reason when there is one (tonic's own message is only "transport error").
pub async fn connect(router: &str, tls: Option<&ferry_proto::tls::ClientTls>) -> anyhow::Result<tonic::transport::Channel> {
    let ep = ferry_proto::tls::endpoint(router, tls)?.connect_timeout(std::time::Duration::from_secs(10));
    let uri = ep.uri().to_string();
    ep.connect().await.map_err(|e| {
        anyhow::anyhow!("Unavailable: cannot connect to the router at {uri}: {} ({})", ferry_proto::tls::error_chain(&e), ferry_proto::tls::connect_hint(tls))
    })
}

/// Local generate's stats line, plus where the request ran and what its KV transfer did.
pub fn stats_line(f: &v1::GenerateFinal) -> String {
    let finish = v1::FinishReason::try_from(f.finish_reason).unwrap_or(v1::FinishReason::Unspecified);
    let tpot = if f.completion_tokens > 1 { format!("{:.2} ms", f.tpot_ms) } else { "n/a".into() };
    let tps = if f.tpot_ms > 0.0 { 1e3 / f.tpot_ms } else { 0.0 };
    let kv = f.kv.unwrap_or_default();
    let transport = v1::KvTransport::try_from(kv.transport).unwrap_or(v1::KvTransport::Unspecified);
    format!(
        "[{} prompt tokens ({} cached), {} generated, finish {:?}] TTFT {:.1} ms · TPOT {} · {:.1} tok/s · prefill={} decode={} kv={} in {:.2} ms ({})",
        f.prompt_tokens, f.cached_tokens, f.completion_tokens, finish, f.ttft_ms, tpot, tps, f.prefill_worker, f.decode_worker, kv.bytes, kv.duration_ms, transport
    )
}
