//! `ferry generate`: one prompt, streamed to stdout; timings to stderr.

use crate::ModelArgs;
use ferry_core::SamplingParams;
use ferry_tokenizer::{ChatMessage, Role};
use std::io::Write;

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Apply the model's chat template (the prompt becomes the user message).
    #[arg(long)]
    pub chat: bool,
    /// System message for --chat.
    #[arg(long)]
    pub system: Option<String>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Send the request to a Ferry router (host:port) instead of running the model here.
    #[arg(long)]
    pub router: Option<String>,
    /// API key for a router that requires one (with --router).
    #[arg(long, env = "FERRY_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// TLS to the router (with --router).
    #[command(flatten)]
    pub tls: crate::tls_args::DialTlsArgs,
    /// The prompt.
    pub prompt: String,
}

#[derive(clap::Args, Debug, Clone)]
pub struct SamplingArgs {
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when the text contains this string (repeatable).
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// Stop after this token id (repeatable; EOS is always a stop unless --ignore-eos).
    #[arg(long = "stop-token")]
    pub stop_token: Vec<u32>,
    #[arg(long)]
    pub ignore_eos: bool,
    /// Keep only tokens at least this fraction as likely as the most likely one (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Divide (multiply, if negative) the logits of tokens already in the prompt or output (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Subtract this per occurrence of a token in the output so far (-2 to 2).
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Subtract this once from every token in the output so far (-2 to 2).
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Add a bias to a token's logit, as ID=BIAS (repeatable; -100 to 100).
    #[arg(long = "logit-bias", value_parser = parse_bias)]
    pub logit_bias: Vec<(u32, f32)>,
    /// No stop token or stop string ends the text before this many tokens.
    #[arg(long, default_value_t = 0)]
    pub min_tokens: usize,
    /// A word the output never contains (repeatable).
    #[arg(long = "bad-word")]
    pub bad_words: Vec<String>,
}

fn parse_bias(s: &str) -> Result<(u32, f32), String> {
    let (id, bias) = s.split_once('=').ok_or_else(|| format!("expected ID=BIAS, got {s:?}"))?;
    let id = id.trim().parse().map_err(|_| format!("{id:?} is not a token id"))?;
    let bias = bias.trim().parse().map_err(|_| format!("{bias:?} is not a number"))?;
    Ok((id, bias))
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
            max_tokens: self.max_tokens,
            stop_token_ids: self.stop_token.clone(),
            stop_strings: self.stop.clone(),
            ignore_eos: self.ignore_eos,
            token_offset: 0,
            grammar: None,
            logprobs: None,
            prompt_logprobs: None,
            n: 1,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            repetition_penalty: self.repetition_penalty,
            logit_bias: self.logit_bias.clone(),
            min_p: self.min_p,
            min_tokens: self.min_tokens,
            bad_words: self.bad_words.clone(),
        }
    }
}

pub fn run(a: GenerateArgs) -> anyhow::Result<()> {
    let params = a.sampling.params();
    if let Some(router) = &a.router {
        return crate::remote::generate_remote(&crate::remote::RemoteGenerate {
            router: router.clone(),
            prompt: a.prompt.clone(),
            chat: a.chat,
            system: a.system.clone(),
            params,
            api_key: a.api_key.clone(),
            tls: a.tls.client()?,
        });
    }
    params.validate()?;
    // As a worker would serve it (fast decode); `--activations exact` for the reference math.
    let mut engine = a.model.load(crate::ActivationsArg::Q8)?;
    let ids = if a.chat {
        let tpl = engine.chat_template.as_ref().ok_or_else(|| anyhow::anyhow!("--chat: the model has no chat template"))?;
        let mut msgs = Vec::new();
        if let Some(s) = &a.system {
            msgs.push(ChatMessage::new(Role::System, s.clone()));
        }
        msgs.push(ChatMessage::new(Role::User, a.prompt.clone()));
        // The template writes the special tokens itself.
        engine.tokenizer.encode(&tpl.render(&msgs, true)?, false)?
    } else {
        engine.encode(&a.prompt)?
    };
    let mut out = std::io::stdout().lock();
    let g = engine.generate(&ids, &params, &mut |t| {
        let _ = out.write_all(t.as_bytes());
        let _ = out.flush();
    })?;
    drop(out);
    println!();
    let n = g.tokens.len();
    let tpot = g.tpot().map(|d| format!("{:.2} ms", d.as_secs_f64() * 1e3)).unwrap_or_else(|| "n/a".into());
    let tps = if g.decode_time.as_secs_f64() > 0.0 && n > 1 { (n - 1) as f64 / g.decode_time.as_secs_f64() } else { 0.0 };
    eprintln!(
        "[{} prompt tokens, {} generated, finish {:?}] TTFT {:.1} ms · TPOT {} · {:.1} tok/s · {}",
        g.prompt_tokens,
        n,
        g.finish,
        g.ttft.as_secs_f64() * 1e3,
        tpot,
        tps,
        ferry_engine::backend::Backend::describe(engine.backend())
    );
    Ok(())
}
