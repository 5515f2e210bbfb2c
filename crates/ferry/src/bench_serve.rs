//! `ferry bench serve`: an open-loop load generator against any Ferry router (disaggregated or
//! colocated workers behind it): Poisson arrivals at each rate of a sweep, prompt and output
//! lengths from a fixed value, a uniform range or a JSONL file, and per rate the TTFT, TPOT and
//! end-to-end percentiles, throughput and SLO attainment; then goodput, the largest rate at which
//! at least 90% of requests met both latency targets. The arithmetic is `crate::loadgen`'s.
//!
//! JSONL workload format: one object per line, `{"prompt": "text", "max_tokens": 128}`; each
//! rate of a sweep takes the next `--requests` lines, cycling through the file when it runs out
//! (then a rate replays lines an earlier one sent: `reused_prompts` says how many).
//!
//! Every rate reports the prompt tokens its requests sent and those the workers served from their
//! prefix caches (`cached_tokens`, summed over the router's per-request count), so a reader sees
//! whether a rate measured the workload or the cache. Each rate of a sweep gets its own prompts
//! (random: ids shifted per rate; copy and multiturn: content drawn from the seed and the rate's
//! place; dataset: the next lines).
//!
//! `--trace FILE` replays a Mooncake-format trace instead ([`crate::trace_workload`]): its arrivals
//! (times `--trace-time-scale`), its lengths and its prefix sharing (hash ids become token blocks
//! of `--trace-block-tokens`), once, and reports the cache hit rate beside the oracle the hash ids
//! imply.
//!
//! `--save-outputs FILE` writes every completed request's answer (ids and text) as a JSON line, and
//! each rate's result carries `outputs_digest`, an FNV-1a hash over the answers in request order:
//! two runs that must answer alike (speculative decoding on and off) are compared at a glance.

use anyhow::Context;
use crate::loadgen::{self, LenDist, Sample, Slo};
use ferry_proto::v1::{generate_request, generate_response, ChatInput, ChatMessage, GenerateFinal, GenerateRequest, ModelInfoRequest, StopConditions, TokenInput};
use std::io::Write;
use serde_json::json;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct ServeBenchArgs {
    /// The router (host:port).
    #[arg(long, default_value = "127.0.0.1:7700")]
    pub router: String,
    /// API key for a router that requires one.
    #[arg(long, env = "FERRY_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The router's admin token, to read its workers' step clocks (each rate records how long the
    /// workers' steps took against their `--profile`: `step_time`, which `ferry plan --measured`
    /// predicts with). Without access to the worker list, no step time is recorded.
    #[arg(long, env = "FERRY_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Offered request rates (requests/s), comma-separated: one run each (not with --trace: the
    /// trace sets the arrivals).
    #[arg(long, value_delimiter = ',', required_unless_present = "trace", conflicts_with = "trace")]
    pub rates: Vec<f64>,
    /// `random`: independent requests at Poisson arrivals. `multiturn`: conversations on a shared
    /// system prompt, each turn repeating the last prompt and its answer (`--users`, `--turns`,
    /// `--system-tokens`, `--user-tokens`, `--think-ms`; each rate is conversations started per
    /// second). `copy`: chat requests whose answers copy from their prompt (rename a function in
    /// a code block, quote a paragraph, re-indent a JSON document), in turn, at Poisson arrivals;
    /// EOS is honoured (each answer ends when the model says so, at most `--output-len` tokens,
    /// so give 400 or so: the default cuts answers short); no `--prompt-len`.
    #[arg(long, value_enum, default_value_t = Workload::Random)]
    pub workload: Workload,
    /// Requests per rate [random, copy: 50]; with --trace, only the trace's first N.
    #[arg(long, alias = "max-requests")]
    pub requests: Option<usize>,
    /// Replay a Mooncake-format trace (JSON lines of `{"timestamp": ms, "input_length": n,
    /// "output_length": n, "hash_ids": [..]}`): its arrivals, lengths and shared prefixes, once.
    #[arg(long, conflicts_with_all = ["dataset", "prompt_len"])]
    pub trace: Option<PathBuf>,
    /// --trace: prompt tokens per hash id (512 in the format; fewer replays the same sharing in
    /// fewer tokens, every length scaled alike). Make it a multiple of the workers' KV block size.
    #[arg(long, default_value_t = crate::trace_workload::MOONCAKE_BLOCK_TOKENS)]
    pub trace_block_tokens: usize,
    /// --trace: multiply the trace's times by this (0.1 replays ten times faster).
    #[arg(long, default_value_t = 1.0)]
    pub trace_time_scale: f64,
    /// --trace: at most this many output tokens per request (default: the trace's).
    #[arg(long)]
    pub trace_max_output: Option<usize>,
    /// At most this many requests in flight; a request due while that many are waits for one to
    /// finish, and its latencies count from when it is sent (default: no limit, open loop).
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Prompt length in tokens: `N` or `LO..HI` (uniform) [random: 64..1024; not with --dataset].
    #[arg(long, conflicts_with = "dataset")]
    pub prompt_len: Option<String>,
    /// Output (multiturn: answer) length in tokens (EOS ignored, so each request generates
    /// exactly this many; copy: max_tokens, EOS honoured).
    #[arg(long, default_value = "64..256")]
    pub output_len: String,
    /// A JSONL file of `{"prompt": ..., "max_tokens": ...}` instead of synthetic prompts.
    #[arg(long)]
    pub dataset: Option<PathBuf>,
    /// multiturn: conversations [8].
    #[arg(long)]
    pub users: Option<usize>,
    /// multiturn: turns per conversation [4].
    #[arg(long)]
    pub turns: Option<usize>,
    /// multiturn: tokens of the system prompt every conversation shares [300].
    #[arg(long)]
    pub system_tokens: Option<usize>,
    /// multiturn: tokens of each user message, `N` or `LO..HI` [20..60].
    #[arg(long)]
    pub user_tokens: Option<String>,
    /// multiturn: mean think time between an answer and the next turn, ms (exponential) [1000].
    #[arg(long)]
    pub think_ms: Option<f64>,
    /// multiturn, --trace: the workers' KV block size, for the oracle's whole blocks [16].
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Seed for lengths, prompts and arrival times: the same seed gives the same workload.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Sample at this temperature instead of greedy (not multiturn): each request with its own
    /// seed, drawn from `--seed`, its rate and its place, so two runs of one workload sample the
    /// same answers (speculation on and off compare; `outputs_digest` says whether they do).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[command(flatten)]
    pub slo: crate::bench_serve::SloArgs,
    /// A name for this configuration in the output and the plot.
    #[arg(long, default_value = "ferry")]
    pub label: String,
    /// Write each completed request's answer here, one JSON line each: `{"rate", "index",
    /// "prompt_tokens", "tokens", "text"}` (copy: and `"task"`), to diff two runs [not multiturn].
    #[arg(long)]
    pub save_outputs: Option<PathBuf>,
    /// Write the results as JSON here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Write an SVG plot of TTFT p99 and TPOT p99 against the rate here.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Earlier results (JSON from --out) to draw in the same plot.
    #[arg(long, value_delimiter = ',')]
    pub compare: Vec<PathBuf>,
}

/// Latency targets, as `bench serve`, `plan` and `--autoscale` take them.
#[derive(clap::Args, Debug, Clone)]
pub struct SloArgs {
    /// TTFT target (ms).
    #[arg(long, default_value_t = 5000.0)]
    pub slo_ttft_ms: f64,
    /// TPOT target (ms).
    #[arg(long, default_value_t = 100.0)]
    pub slo_tpot_ms: f64,
    /// Fraction of requests that must meet both targets (for a rate to count toward goodput).
    #[arg(long, default_value_t = 0.9)]
    pub slo_target: f64,
}

impl Default for SloArgs {
    fn default() -> Self {
        SloArgs { slo_ttft_ms: 5000.0, slo_tpot_ms: 100.0, slo_target: 0.9 }
    }
}

impl SloArgs {
    pub fn slo(&self) -> Slo {
        Slo { ttft_ms: self.slo_ttft_ms, tpot_ms: self.slo_tpot_ms }
    }
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    Random,
    Multiturn,
    Copy,
}

/// A progress bar of requests on stderr, drawn only on a terminal.
pub(crate) fn progress(len: u64) -> indicatif::ProgressBar {
    progress_styled(len, "{bar:40} {pos}/{len} requests  {per_sec}  {elapsed}  {msg}")
}

/// A progress bar on stderr drawn with an indicatif `template`, only on a terminal.
pub(crate) fn progress_styled(len: u64, template: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(len);
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar.set_style(indicatif::ProgressStyle::with_template(template).unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()));
    bar
}

enum Input {
    Ids(Vec<u32>),
    Text(String),
    /// One user message, rendered with the model's chat template.
    Chat(String),
}

struct Planned {
    at: f64,
    /// The requests of this run before this one that sent the same prompt (dataset lines reused).
    reused: bool,
    input: Input,
    max_tokens: usize,
    /// The copy workload's task and what a perfect copy answers; EOS is honoured for these.
    copy: Option<(crate::bench_copy::Task, String)>,
    /// Sampled (`--temperature`), with this request's seed; None: greedy.
    sampling: Option<ferry_proto::v1::SamplingParams>,
    /// The prefix cache's salt (empty: none). A trace replay sends one of its own, so it starts
    /// from a cold cache whatever ran on the cluster before, as its oracle assumes.
    salt: String,
}

/// The requests of the `rate_index`-th rate of the sweep (with `--trace`, the trace's).
fn workload(a: &ServeBenchArgs, rate_index: usize, rate: f64, vocab: u32, trace: Option<&[crate::trace_workload::TraceRequest]>) -> anyhow::Result<Vec<Planned>> {
    if let Some(reqs) = trace {
        let b = a.trace_block_tokens;
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let salt = format!("ferry-bench-trace-{}-{nanos:x}", std::process::id());
        return Ok(reqs
            .iter()
            .enumerate()
            .map(|(i, r)| Planned { at: r.at, reused: false, input: Input::Ids(crate::trace_workload::prompt_ids(r, i, b, vocab)), max_tokens: r.output, copy: None, sampling: None, salt: salt.clone() })
            .collect());
    }
    if a.workload == Workload::Copy {
        let ol = LenDist::parse(&a.output_len).map_err(|e| anyhow::anyhow!("--output-len: {e}"))?;
        let reqs = crate::bench_copy::copy_requests(a.seed, rate_index, rate, a.requests.unwrap_or(50), ol);
        return Ok(reqs.into_iter().map(|r| Planned { at: r.at, reused: false, input: Input::Chat(r.message), max_tokens: r.max_tokens, copy: Some((r.task, r.expected)), sampling: None, salt: String::new() }).collect());
    }
    let mut u = loadgen::uniforms(a.seed);
    let arrivals = loadgen::poisson_arrivals(rate, a.requests.unwrap_or(50), &mut u);
    if let Some(path) = &a.dataset {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut rows = Vec::new();
        for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let v: serde_json::Value = serde_json::from_str(line).with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
            let prompt = v["prompt"].as_str().with_context(|| format!("{}:{}: no string \"prompt\"", path.display(), i + 1))?;
            let max = v["max_tokens"].as_u64().with_context(|| format!("{}:{}: no integer \"max_tokens\"", path.display(), i + 1))?;
            anyhow::ensure!(max >= 1, "{}:{}: max_tokens must be at least 1", path.display(), i + 1);
            rows.push((prompt.to_string(), max as usize));
        }
        anyhow::ensure!(!rows.is_empty(), "{} has no requests", path.display());
        // This rate takes the lines after the earlier rates' (cycling): a line sent before is
        // marked reused, and counted in the rate's results.
        let first = rate_index * arrivals.len();
        return Ok(arrivals
            .into_iter()
            .enumerate()
            .map(|(i, at)| {
                let (prompt, max) = &rows[(first + i) % rows.len()];
                Planned { at, reused: first + i >= rows.len(), input: Input::Text(prompt.clone()), max_tokens: *max, copy: None, sampling: None, salt: String::new() }
            })
            .collect());
    }
    let (pl, ol) = (LenDist::parse(a.prompt_len.as_deref().unwrap_or("64..1024")).map_err(anyhow::Error::msg)?, LenDist::parse(&a.output_len).map_err(anyhow::Error::msg)?);
    let reqs = loadgen::random_requests(a.seed, rate_index, rate, a.requests.unwrap_or(50), pl, ol, vocab);
    Ok(reqs.into_iter().map(|r| Planned { at: r.at, reused: false, input: Input::Ids(r.ids), max_tokens: r.output, copy: None, sampling: None, salt: String::new() }).collect())
}

async fn one(client: crate::remote::Client, p: Planned) -> Streamed {
    let input = match p.input {
        Input::Ids(ids) => generate_request::Input::Tokens(TokenInput { ids }),
        Input::Text(t) => generate_request::Input::Prompt(t),
        Input::Chat(content) => generate_request::Input::Chat(ChatInput { messages: vec![ChatMessage { role: "user".into(), content, ..Default::default() }] }),
    };
    let stop = StopConditions { max_tokens: p.max_tokens as u32, ignore_eos: p.copy.is_none(), ..Default::default() };
    stream_request(client, GenerateRequest { input: Some(input), stop: Some(stop), sampling: p.sampling, cache_salt: p.salt, ..Default::default() }).await
}

/// One streamed request, as the client saw it.
pub(crate) struct Streamed {
    pub sample: Sample,
    /// The ids streamed.
    pub ids: Vec<u32>,
    /// The text streamed.
    pub text: String,
    /// The router's summary (None when the request failed).
    pub summary: Option<GenerateFinal>,
}

/// Send one greedy request of `max_tokens` (EOS ignored) and time its stream.
pub(crate) async fn stream(client: crate::remote::Client, input: generate_request::Input, max_tokens: usize) -> Streamed {
    stream_until(client, input, StopConditions { max_tokens: max_tokens as u32, ignore_eos: true, ..Default::default() }).await
}

/// Send one greedy request that ends at `stop` and time its stream.
pub(crate) async fn stream_until(client: crate::remote::Client, input: generate_request::Input, stop: StopConditions) -> Streamed {
    stream_sampled(client, input, stop, None).await
}

/// [`stream_until`], sampled with `sampling` when given (else greedy).
async fn stream_sampled(client: crate::remote::Client, input: generate_request::Input, stop: StopConditions, sampling: Option<ferry_proto::v1::SamplingParams>) -> Streamed {
    stream_request(client, GenerateRequest { input: Some(input), stop: Some(stop), sampling, ..Default::default() }).await
}

/// Send `req` and time its stream.
async fn stream_request(mut client: crate::remote::Client, req: GenerateRequest) -> Streamed {
    let t0 = Instant::now();
    let failed = |t0: Instant, ids: Vec<u32>| Streamed { sample: Sample { ok: false, ttft_ms: f64::INFINITY, tpot_ms: f64::INFINITY, e2e_ms: t0.elapsed().as_secs_f64() * 1e3, output_tokens: 0 }, ids, text: String::new(), summary: None };
    let Ok(resp) = client.generate(req).await else { return failed(t0, Vec::new()) };
    let mut s = resp.into_inner();
    let (mut first, mut last, mut ids, mut text, mut summary) = (None, Duration::ZERO, Vec::new(), String::new(), None);
    loop {
        match s.message().await {
            Ok(Some(m)) => match m.event {
                Some(generate_response::Event::Delta(d)) => {
                    text.push_str(&d.text);
                    if !d.token_ids.is_empty() {
                        last = t0.elapsed();
                        first.get_or_insert(last);
                        ids.extend(d.token_ids);
                    }
                }
                Some(generate_response::Event::Final(f)) => {
                    summary = Some(f);
                    break;
                }
                _ => {}
            },
            Ok(None) => break,
            Err(_) => return failed(t0, ids),
        }
    }
    let Some(first) = first else { return failed(t0, ids) };
    let n = ids.len();
    let tpot = if n >= 2 { (last - first).as_secs_f64() * 1e3 / (n - 1) as f64 } else { 0.0 };
    Streamed { sample: Sample { ok: true, ttft_ms: first.as_secs_f64() * 1e3, tpot_ms: tpot, e2e_ms: t0.elapsed().as_secs_f64() * 1e3, output_tokens: n }, ids, text, summary }
}

/// One request of a run: when it was sent (seconds after the run started), its prompt's length
/// (for a text or chat prompt, as the router counted it; None when it failed first), what the
/// client saw and the answer; for the copy workload, its task and whether it copied exactly.
struct Record {
    at: f64,
    prompt_tokens: Option<usize>,
    /// Of those, the ones a prefix cache served (None when it failed first).
    cached_tokens: Option<usize>,
    /// A dataset line an earlier rate of the sweep sent too.
    reused: bool,
    sample: Sample,
    ids: Vec<u32>,
    text: String,
    copy: Option<(crate::bench_copy::Task, bool)>,
}

impl Record {
    fn samples(records: &[Record]) -> Vec<Sample> {
        records.iter().map(|r| r.sample).collect()
    }

    fn json(&self) -> serde_json::Value {
        let s = &self.sample;
        let finite = |x: f64| x.is_finite().then_some(x);
        let mut v = json!({ "at_s": self.at, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens, "output_tokens": s.output_tokens, "ok": s.ok,
                "ttft_ms": finite(s.ttft_ms), "tpot_ms": finite(s.tpot_ms), "e2e_ms": s.e2e_ms });
        if let Some((task, copied)) = self.copy {
            v["task"] = task.name().into();
            v["copied"] = copied.into();
        }
        v
    }

    /// The `--save-outputs` line of the `index`-th request at `rate` (completed requests only).
    fn output_line(&self, rate: f64, index: usize) -> serde_json::Value {
        let mut v = json!({ "rate": rate, "index": index, "prompt_tokens": self.prompt_tokens, "tokens": self.ids, "text": self.text });
        if let Some((task, _)) = self.copy {
            v["task"] = task.name().into();
        }
        v
    }
}

/// The copy workload's figures per task: answers, exact copies, mean output tokens.
fn copy_tasks(records: &[Record]) -> serde_json::Value {
    let mut out = serde_json::Map::new();
    for task in crate::bench_copy::Task::ALL {
        let done: Vec<&Record> = records.iter().filter(|r| r.sample.ok && r.copy.is_some_and(|(t, _)| t == task)).collect();
        let exact = done.iter().filter(|r| r.copy.is_some_and(|(_, c)| c)).count();
        let mean = done.iter().map(|r| r.sample.output_tokens as f64).sum::<f64>() / done.len().max(1) as f64;
        out.insert(task.name().into(), json!({ "completed": done.len(), "copied_exactly": exact, "output_tokens_mean": mean }));
    }
    out.into()
}

/// Of the prompt tokens of the requests that completed, the fraction served from a prefix cache.
fn cache_hit_rate(records: &[Record]) -> f64 {
    let (mut prompt, mut cached) = (0, 0);
    for r in records.iter().filter(|r| r.sample.ok) {
        prompt += r.prompt_tokens.unwrap_or(0);
        cached += r.cached_tokens.unwrap_or(0);
    }
    cached as f64 / prompt.max(1) as f64
}

/// One rate's figures; `started` is when its first request could leave (Unix seconds), to line
/// its requests' `at_s` up with other clocks (the autoscaler's moves).
fn summary(rate: f64, records: &[Record], wall: f64, started: f64, step_time: serde_json::Value, slo: &Slo) -> serde_json::Value {
    let samples = Record::samples(records);
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
    let pct = |f: &dyn Fn(&Sample) -> f64| {
        let v: Vec<f64> = ok.iter().map(|s| f(s)).collect();
        json!({ "p50": loadgen::percentile(&v, 50.0), "p90": loadgen::percentile(&v, 90.0), "p99": loadgen::percentile(&v, 99.0) })
    };
    let tokens: usize = ok.iter().map(|s| s.output_tokens).sum();
    let answers: Vec<Option<(&[u32], &str)>> = records.iter().map(|r| r.sample.ok.then_some((r.ids.as_slice(), r.text.as_str()))).collect();
    let mut v = json!({
        "rate": rate,
        "requests": samples.len(),
        "completed": ok.len(),
        "wall_s": wall,
        "started_unix_s": started,
        "throughput_rps": ok.len() as f64 / wall,
        "output_tok_per_s": tokens as f64 / wall,
        "output_tokens_mean": tokens as f64 / ok.len().max(1) as f64,
        "outputs_digest": loadgen::outputs_digest(&answers),
        "prompt_tokens": records.iter().filter_map(|r| r.prompt_tokens).sum::<usize>(),
        "cached_tokens": records.iter().filter_map(|r| r.cached_tokens).sum::<usize>(),
        "cache_hit_rate": cache_hit_rate(records),
        "reused_prompts": records.iter().filter(|r| r.reused).count(),
        "ttft_ms": pct(&|s| s.ttft_ms),
        "tpot_ms": pct(&|s| s.tpot_ms),
        "e2e_ms": pct(&|s| s.e2e_ms),
        "slo_attainment": loadgen::attainment(&samples, slo),
        "step_time": step_time,
        "samples": records.iter().map(Record::json).collect::<Vec<_>>(),
    });
    if records.iter().any(|r| r.copy.is_some()) {
        v["tasks"] = copy_tasks(records);
    }
    v
}

/// Every worker's priced-step counters: (id, role, seconds taken, seconds its profile says).
type Clocks = Vec<(String, ferry_proto::v1::WorkerRole, f64, f64)>;

async fn clocks(admin: &mut crate::pool_cmd::Admin) -> Result<Clocks, tonic::Status> {
    let list = admin.list_workers(ferry_proto::v1::ListWorkersRequest {}).await?.into_inner();
    Ok(list.workers.into_iter().filter_map(|w| {
        let role = w.role();
        w.load.map(|l| (w.worker_id, role, l.step_seconds, l.step_model_seconds))
    }).collect())
}

/// Per role, how long the workers' steps took between two looks against how long their profile
/// says (`{"prefill": {"ratio": 1.12, "profiled_s": 40.2}, ...}`; a role that ran no priced step
/// is absent). A worker that left between the looks is not counted; one that came, or restarted,
/// from zero ([`ferry_core::autoscale::clock_increases`]).
fn step_time(before: &Clocks, after: &Clocks) -> serde_json::Value {
    let before = before.iter().map(|(id, _, took, profiled)| (id.clone(), (*took, *profiled))).collect();
    let mut by_role: std::collections::BTreeMap<String, (f64, f64)> = Default::default();
    for (role, took, profiled) in ferry_core::autoscale::clock_increases(&before, after) {
        let e = by_role.entry(role.to_string()).or_default();
        e.0 += took;
        e.1 += profiled;
    }
    by_role.into_iter().map(|(role, (t, p))| (role, json!({ "ratio": t / p, "profiled_s": p }))).collect::<serde_json::Map<_, _>>().into()
}

/// The options that belong to another workload, given anyway: refused, not ignored.
fn misplaced(a: &ServeBenchArgs) -> Vec<&'static str> {
    let given = |set: bool, flag: &'static str| set.then_some(flag);
    let multiturn = [
        given(a.users.is_some(), "--users"),
        given(a.turns.is_some(), "--turns"),
        given(a.system_tokens.is_some(), "--system-tokens"),
        given(a.user_tokens.is_some(), "--user-tokens"),
        given(a.think_ms.is_some(), "--think-ms"),
    ];
    let block_size = given(a.block_size.is_some() && a.trace.is_none(), "--block-size");
    let synthetic = [given(a.prompt_len.is_some(), "--prompt-len"), given(a.dataset.is_some(), "--dataset")];
    let trace_only = [
        given(a.trace_block_tokens != crate::trace_workload::MOONCAKE_BLOCK_TOKENS, "--trace-block-tokens"),
        given(a.trace_time_scale != 1.0, "--trace-time-scale"),
        given(a.trace_max_output.is_some(), "--trace-max-output"),
    ];
    if a.trace.is_some() {
        return [given(a.workload != Workload::Random, "--workload")].into_iter().chain(multiturn).flatten().collect();
    }
    let trace_only = trace_only.into_iter().flatten();
    match a.workload {
        Workload::Random => multiturn.into_iter().chain([block_size]).flatten().chain(trace_only).collect(),
        Workload::Multiturn => [given(a.requests.is_some(), "--requests"), given(a.save_outputs.is_some(), "--save-outputs"), given(a.temperature != 0.0, "--temperature")]
            .into_iter()
            .chain(synthetic)
            .flatten()
            .chain(trace_only)
            .collect(),
        Workload::Copy => multiturn.into_iter().chain([block_size]).chain(synthetic).flatten().chain(trace_only).collect(),
    }
}

/// The options' checks that need no router: each refusal names the option.
pub(crate) fn check_options(a: &ServeBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.temperature.is_finite() && a.temperature >= 0.0, "--temperature must be a number >= 0 (got {})", a.temperature);
    let wrong = misplaced(a);
    let with = match a.trace {
        Some(_) => "--trace".to_string(),
        None => format!("--workload {}", format!("{:?}", a.workload).to_lowercase()),
    };
    anyhow::ensure!(wrong.is_empty(), "{} not with {with} (see `ferry bench serve --help`)", wrong.join(", "));
    anyhow::ensure!(a.requests.unwrap_or(1) >= 1, "--requests must be at least 1");
    anyhow::ensure!(a.rates.iter().all(|r| r.is_finite() && *r > 0.0), "--rates must be positive numbers");
    anyhow::ensure!(a.max_concurrency.unwrap_or(1) >= 1, "--max-concurrency must be at least 1");
    Ok(())
}

pub fn run(a: ServeBenchArgs) -> anyhow::Result<()> {
    check_options(&a)?;
    let mut saved = match &a.save_outputs {
        Some(p) => Some(std::io::BufWriter::new(std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?)),
        None => None,
    };
    let slo = a.slo.slo();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let (client, vocab, mut admin) = rt.block_on(async {
        let bearer = crate::remote::Bearer::new(a.api_key.as_deref()).map_err(|e| anyhow::anyhow!("--api-key: {e}"))?;
        let uri = format!("http://{}", a.router);
        let channel = tonic::transport::Endpoint::from_shared(uri.clone())?.connect().await.with_context(|| format!("cannot reach the router at {uri}"))?;
        let mut client = crate::remote::client(channel.clone(), bearer);
        let vocab = client.model_info(ModelInfoRequest {}).await?.into_inner().vocab_size;
        let auth = ferry_proto::Bearer::new(a.admin_token.as_deref()).map_err(|e| anyhow::anyhow!("--admin-token: {e}"))?;
        let admin = ferry_proto::v1::admin_client::AdminClient::with_interceptor(channel, auth);
        anyhow::Ok((client, vocab, admin))
    })?;
    if a.workload == Workload::Multiturn {
        let result = crate::bench_multiturn::run(&a, client, vocab, &rt)?;
        return write_results(&a, result, crate::plot::ttft_by_turn);
    }
    let trace = a.trace.as_ref().map(|p| crate::bench_trace::requests(&a, p)).transpose()?;
    let rates: Vec<f64> = match &trace {
        Some(t) => vec![crate::bench_trace::rate(t)],
        None => a.rates.clone(),
    };
    let limit = a.max_concurrency.map(|n| std::sync::Arc::new(tokio::sync::Semaphore::new(n)));
    let runs = rt.block_on(async {
        let bar = progress(trace.as_ref().map_or(a.requests.unwrap_or(50) * rates.len(), Vec::len) as u64);
        let mut runs = Vec::new();
        for (rate_index, &rate) in rates.iter().enumerate() {
            bar.set_message(format!("rate {rate:.3}/s"));
            let mut plan = workload(&a, rate_index, rate, vocab, trace.as_deref())?;
            if a.temperature > 0.0 {
                for (i, p) in plan.iter_mut().enumerate() {
                    let seed = a.seed ^ (rate_index as u64).rotate_left(40) ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    p.sampling = Some(ferry_proto::v1::SamplingParams { temperature: a.temperature, seed: Some(seed), ..Default::default() });
                }
            }
            let before = match clocks(&mut admin).await {
                Ok(c) => Some(c),
                Err(e) => {
                    bar.suspend(|| eprintln!("bench serve: the workers' step time is not recorded (listing them: {})", e.message()));
                    None
                }
            };
            let start = tokio::time::Instant::now();
            let started = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
            let mut tasks = Vec::new();
            for p in plan {
                let c = client.clone();
                let bar = bar.clone();
                // With a limit, requests take their slots here, one after another in arrival
                // order (tasks racing for the semaphore could swap two that are due together, and
                // a trace's later turn would run before its earlier one). Held until the request
                // is done (None: no limit, or the semaphore closed).
                let slot = match &limit {
                    Some(l) => {
                        tokio::time::sleep_until(start + Duration::from_secs_f64(p.at)).await;
                        l.clone().acquire_owned().await.ok()
                    }
                    None => None,
                };
                tasks.push(tokio::spawn(async move {
                    tokio::time::sleep_until(start + Duration::from_secs_f64(p.at)).await;
                    let _slot = slot;
                    let (at, sent_ids) = (p.at, match &p.input {
                        Input::Ids(ids) => Some(ids.len()),
                        Input::Text(_) | Input::Chat(_) => None,
                    });
                    let (copy, reused) = (p.copy.clone(), p.reused);
                    let s = one(c, p).await;
                    bar.inc(1);
                    let prompt_tokens = sent_ids.or(s.summary.as_ref().map(|f| f.prompt_tokens as usize));
                    let copy = copy.map(|(task, expected)| (task, s.sample.ok && crate::bench_copy::copied(&expected, &s.text)));
                    let cached_tokens = s.summary.as_ref().map(|f| f.cached_tokens as usize);
                    Record { at, prompt_tokens, cached_tokens, reused, sample: s.sample, ids: s.ids, text: s.text, copy }
                }));
            }
            let mut samples: Vec<Record> = Vec::new();
            for t in tasks {
                samples.push(t.await?);
            }
            if let Some(w) = saved.as_mut() {
                for (i, r) in samples.iter().enumerate().filter(|(_, r)| r.sample.ok) {
                    writeln!(w, "{}", r.output_line(rate, i)).context("writing --save-outputs")?;
                }
                w.flush().context("writing --save-outputs")?;
            }
            let wall = start.elapsed().as_secs_f64();
            let step = match before {
                Some(b) => clocks(&mut admin).await.map_or(serde_json::Value::Null, |after| step_time(&b, &after)),
                None => serde_json::Value::Null,
            };
            runs.push((rate, samples, wall, started, step));
        }
        bar.finish_and_clear();
        anyhow::Ok(runs)
    })?;
    let mut summaries: Vec<serde_json::Value> = runs.into_iter().map(|(r, s, w, t, step)| summary(r, &s, w, t, step, &slo)).collect();
    if let (Some(t), Some(run)) = (&trace, summaries.first_mut()) {
        run["oracle"] = crate::bench_trace::oracle(t, a.trace_block_tokens, a.block_size.unwrap_or(16), run);
    }
    let att: Vec<(f64, f64)> = summaries.iter().map(|s| (s["rate"].as_f64().unwrap_or(0.0), s["slo_attainment"].as_f64().unwrap_or(0.0))).collect();
    let goodput = loadgen::goodput(&att, a.slo.slo_target);
    println!("{}: SLO TTFT <= {} ms and TPOT <= {} ms for {:.0}% of requests", a.label, a.slo.slo_ttft_ms, a.slo.slo_tpot_ms, a.slo.slo_target * 100.0);
    println!("{:>7} {:>9} {:>7} {:>8} | {:>23} | {:>20} | {:>23} | {:>6}", "rate", "completed", "req/s", "tok/s", "TTFT ms p50/p90/p99", "TPOT ms p50/p90/p99", "E2E ms p50/p90/p99", "SLO %");
    for s in &summaries {
        let t = |k: &str, q: &str| s[k][q].as_f64().unwrap_or(f64::NAN);
        println!(
            "{:>7.3} {:>5}/{:<3} {:>7.3} {:>8.1} | {:>7.0} {:>7.0} {:>7.0} | {:>6.1} {:>6.1} {:>6.1} | {:>7.0} {:>7.0} {:>7.0} | {:>6.1}",
            s["rate"].as_f64().unwrap_or(0.0),
            s["completed"],
            s["requests"],
            s["throughput_rps"].as_f64().unwrap_or(0.0),
            s["output_tok_per_s"].as_f64().unwrap_or(0.0),
            t("ttft_ms", "p50"),
            t("ttft_ms", "p90"),
            t("ttft_ms", "p99"),
            t("tpot_ms", "p50"),
            t("tpot_ms", "p90"),
            t("tpot_ms", "p99"),
            t("e2e_ms", "p50"),
            t("e2e_ms", "p90"),
            t("e2e_ms", "p99"),
            s["slo_attainment"].as_f64().unwrap_or(0.0) * 100.0
        );
    }
    for s in &summaries {
        print!("rate {}: {:.1} output tokens/request, outputs digest {}", s["rate"], s["output_tokens_mean"].as_f64().unwrap_or(0.0), s["outputs_digest"].as_str().unwrap_or("-"));
        for (task, t) in s["tasks"].as_object().into_iter().flatten() {
            print!("; {task} {}/{} copied exactly, {:.1} tokens", t["copied_exactly"], t["completed"], t["output_tokens_mean"].as_f64().unwrap_or(0.0));
        }
        println!();
        println!(
            "rate {}: prompt tokens {}, served from the prefix cache {} ({:.1}% of completed requests' prompts){}",
            s["rate"],
            s["prompt_tokens"],
            s["cached_tokens"],
            s["cache_hit_rate"].as_f64().unwrap_or(0.0) * 100.0,
            match s["reused_prompts"].as_u64().unwrap_or(0) {
                0 => String::new(),
                n => format!("; {n} prompts were sent by an earlier rate too (the dataset ran out of lines)"),
            }
        );
        if let Some(o) = s.get("oracle") {
            let pct = |k: &str| o[k].as_f64().unwrap_or(f64::NAN) * 100.0;
            println!(
                "trace: cache hit rate {:.1}%; the hash ids imply {:.1}% (unbounded cache), {:.1}% in whole {}-token cache blocks; measured / oracle = {:.3}",
                pct("measured_hit_rate"),
                pct("hit_rate"),
                pct("servable_hit_rate"),
                o["cache_block"],
                o["measured_over_servable"].as_f64().unwrap_or(f64::NAN)
            );
        }
    }
    match goodput {
        Some(g) => println!("goodput: {g} requests/s"),
        None => println!("goodput: no rate met the SLO for {:.0}% of requests", a.slo.slo_target * 100.0),
    }
    let result = json!({
        "bench": "serve",
        "label": a.label,
        "router": a.router,
        "slo": { "ttft_ms": a.slo.slo_ttft_ms, "tpot_ms": a.slo.slo_tpot_ms, "target": a.slo.slo_target },
        "workload": { "kind": format!("{:?}", a.workload).to_lowercase(), "temperature": a.temperature, "requests_per_rate": a.requests, "prompt_len": a.prompt_len, "output_len": a.output_len,
                      "dataset": a.dataset.as_ref().map(|p| p.display().to_string()), "seed": a.seed,
                      "trace": a.trace.as_ref().map(|p| p.display().to_string()), "trace_block_tokens": a.trace.as_ref().map(|_| a.trace_block_tokens),
                      "trace_time_scale": a.trace.as_ref().map(|_| a.trace_time_scale), "max_concurrency": a.max_concurrency },
        "runs": summaries,
        "goodput_rps": goodput,
    });
    write_results(&a, result, crate::plot::latency_vs_rate)
}

/// `--out` and `--plot` (with the `--compare` results).
fn write_results(a: &ServeBenchArgs, result: serde_json::Value, plot_of: fn(&[serde_json::Value]) -> String) -> anyhow::Result<()> {
    if let Some(out) = &a.out {
        std::fs::write(out, serde_json::to_string_pretty(&result)?).with_context(|| format!("writing {}", out.display()))?;
    }
    if let Some(plot) = &a.plot {
        let mut all = vec![result];
        for c in &a.compare {
            let text = std::fs::read_to_string(c).with_context(|| format!("reading {}", c.display()))?;
            all.push(serde_json::from_str(&text).with_context(|| format!("{}: not a `bench serve` result", c.display()))?);
        }
        std::fs::write(plot, plot_of(&all)).with_context(|| format!("writing {}", plot.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use ferry_proto::v1::WorkerRole::{Decode, Prefill};

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        a: ServeBenchArgs,
    }

    #[test]
    fn a_trace_takes_its_own_options_and_refuses_the_others() {
        let check = |args: &[&str]| Cli::try_parse_from(std::iter::once(&"ferry").chain(args)).map_err(|e| e.to_string()).and_then(|c| check_options(&c.a).map_err(|e| e.to_string()));
        assert!(check(&["--trace", "t.jsonl", "--trace-block-tokens", "64", "--trace-time-scale", "0.1", "--max-requests", "8", "--block-size", "16", "--max-concurrency", "1"]).is_ok());
        // The trace sets the arrivals: no --rates; and one of --rates or --trace is needed.
        assert!(check(&["--trace", "t.jsonl", "--rates", "1"]).unwrap_err().contains("--rates"));
        assert!(check(&[]).is_err());
        for (args, says) in [
            (&["--trace", "t.jsonl", "--users", "3"][..], "--users not with --trace"),
            (&["--trace", "t.jsonl", "--workload", "copy"][..], "--workload not with --trace"),
            (&["--rates", "1", "--trace-block-tokens", "64"][..], "--trace-block-tokens not with --workload random"),
            (&["--rates", "1", "--trace-time-scale", "0.5"][..], "--trace-time-scale"),
            (&["--rates", "1", "--block-size", "16"][..], "--block-size"),
            (&["--rates", "1", "--max-concurrency", "0"][..], "at least 1"),
        ] {
            let e = check(args).unwrap_err();
            assert!(e.contains(says), "{args:?}: {e}");
        }
        assert!(check(&["--rates", "1", "--workload", "multiturn", "--block-size", "16"]).is_ok());
    }

    #[test]
    fn step_time_is_the_ratio_of_each_role_s_increases_between_two_looks() {
        let clocks = |ws: &[(&str, ferry_proto::v1::WorkerRole, f64, f64)]| -> Clocks { ws.iter().map(|&(id, r, t, p)| (id.to_string(), r, t, p)).collect() };
        let before = clocks(&[("prefill-1", Prefill, 10.0, 10.0), ("decode-1", Decode, 5.0, 4.0), ("decode-2", Decode, 1.0, 1.0)]);
        // prefill-1 ran 6 s for 4 profiled; prefill-2 came (from zero) and ran 3 s for 2; decode-1
        // restarted (its counters went back: counted from zero); decode-2 left.
        let after = clocks(&[("prefill-1", Prefill, 16.0, 14.0), ("prefill-2", Prefill, 3.0, 2.0), ("decode-1", Decode, 2.0, 2.5)]);
        let v = step_time(&before, &after);
        assert!((v["prefill"]["ratio"].as_f64().unwrap() - 9.0 / 6.0).abs() < 1e-12, "{v}");
        assert_eq!(v["prefill"]["profiled_s"].as_f64(), Some(6.0));
        assert!((v["decode"]["ratio"].as_f64().unwrap() - 0.8).abs() < 1e-12, "{v}");
        assert!(v.get("colocated").is_none(), "{v}");
        // Nothing priced: nothing recorded.
        assert_eq!(step_time(&after, &after), serde_json::json!({}));
    }
}
