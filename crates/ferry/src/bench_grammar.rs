//! `ferry bench grammar`: what structured outputs cost a decode batch. B sequences (default 8)
//! decode together as on a decode worker, first free, then each under a JSON schema's mask, in
//! alternating rounds; every step's time covers the forward pass and choosing each sequence's
//! token (mask included), the way the batcher runs them. A sequence whose grammar completes is
//! started again outside the timed steps, so the batch stays full. Reports TPOT both ways, the
//! overhead, the mask time per token, and whether every completed answer was valid JSON.
//!
//! With `--router`, it measures instead what hostile grammars cost a running router's normal
//! traffic (issue 32): see [`load`].

use std::time::{Duration, Instant};

use anyhow::Context;
use ferry_core::sampling::OutputGrammar;
use ferry_core::SamplingParams;
use ferry_engine::sampler::Sampler;
use ferry_engine::{Engine, Logits, SeqId, StepItem};
use ferry_grammar::Grammars;
use ferry_worker::pick::Picker;

use crate::ModelArgs;

mod load;

/// A JSON schema of the shape applications ask for: nested object, enum, array, numbers.
const SCHEMA: &str = r#"{"type":"object","properties":{
  "name":{"type":"string"},
  "age":{"type":"integer","minimum":0,"maximum":150},
  "role":{"enum":["engineer","designer","manager","other"]},
  "address":{"type":"object","properties":{"city":{"type":"string"},"zip":{"type":"string"}},"required":["city","zip"],"additionalProperties":false},
  "skills":{"type":"array","items":{"type":"string"}},
  "score":{"type":"number"}},
  "required":["name","age","role","address","skills","score"],"additionalProperties":false}"#;

const QUESTION: &str = "Describe a member of a software team as a JSON object with name, age, role, address, skills and score.";

#[derive(clap::Args, Debug)]
pub struct GrammarBenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Sequences decoding together.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Timed decode steps per round.
    #[arg(long, default_value_t = 64)]
    pub steps: usize,
    /// Rounds of each mode (free and constrained alternate).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Sampling temperature for both modes (0: greedy, which isolates the mask's cost; above 0
    /// the sampler's own work is counted too).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// A JSON schema file to use instead of the built-in one.
    #[arg(long)]
    pub schema: Option<std::path::PathBuf>,
    /// Instead of the batch benchmark: a running router's gRPC address (`ferry up` prints it as
    /// `router=`). Measures normal requests' TTFT in alternating phases without and with the
    /// worst grammar the router accepts sent alongside ([`load`]).
    #[arg(long)]
    pub router: Option<String>,
    /// With --router: seconds per phase.
    #[arg(long, default_value_t = 10)]
    pub phase_seconds: u64,
    /// With --router: phases (half without, half with the hostile grammar, alternating).
    #[arg(long, default_value_t = 6)]
    pub phases: usize,
    /// With --router: hostile grammar requests per second during the loaded phases.
    #[arg(long, default_value_t = 1.0)]
    pub hostile_rps: f64,
}

struct Slot {
    seq: SeqId,
    picker: Picker,
    last: u32,
    out: Vec<u32>,
}

pub fn run(a: GrammarBenchArgs) -> anyhow::Result<()> {
    if let Some(router) = &a.router {
        return load::run(router, a.phase_seconds, a.phases, a.hostile_rps);
    }
    anyhow::ensure!(a.batch >= 1 && a.steps >= 1 && a.rounds >= 1, "--batch, --steps and --rounds must be at least 1");
    let schema = match &a.schema {
        Some(p) => std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
        None => SCHEMA.to_string(),
    };
    let mut engine = a.model.load(crate::ActivationsArg::Q8)?;
    let grammars = Grammars::new(&engine.tokenizer, Some(engine.config().vocab_size))?;
    let grammar = OutputGrammar::JsonSchema(schema);
    grammars.check(&grammar)?;
    let prompt = match &engine.chat_template {
        Some(t) => engine.tokenizer.encode(&t.render(&[ferry_tokenizer::ChatMessage::new(ferry_tokenizer::Role::User, QUESTION)], true)?, false)?,
        None => engine.encode(QUESTION)?,
    };
    let eos = engine.stop_ids(&SamplingParams::greedy(1));
    let report = |mode: &str, step: &[f64], mask: Duration, masked: usize, done: usize, valid: usize| {
        let line = serde_json::json!({
            "bench": "grammar", "mode": mode, "batch": a.batch, "steps": step.len(),
            "tpot_ms_p50": percentile(step, 0.5), "tpot_ms_mean": step.iter().sum::<f64>() / step.len() as f64,
            "mask_us_per_token": if masked == 0 { 0.0 } else { mask.as_secs_f64() * 1e6 / masked as f64 },
            "completed": done, "valid_json": valid,
        });
        println!("{line}");
    };
    let (mut free_all, mut cons_all) = (Vec::new(), Vec::new());
    for round in 0..a.rounds * 2 {
        let constrained = round % 2 == 1;
        let mut slots: Vec<Slot> = Vec::new();
        for i in 0..a.batch {
            slots.push(start(&mut engine, &grammars, constrained.then_some(&grammar), &prompt, a.temperature, i as u64)?);
        }
        let (mut steps, mut mask, mut masked, mut done, mut valid) = (Vec::new(), Duration::ZERO, 0usize, 0usize, 0usize);
        for _ in 0..a.steps {
            let toks: Vec<[u32; 1]> = slots.iter().map(|s| [s.last]).collect();
            let items: Vec<StepItem> = slots.iter().zip(&toks).map(|(s, t)| StepItem { seq: s.seq, tokens: t, logits: Logits::Last }).collect();
            let t0 = Instant::now();
            let logits = engine.step(&items, &mut |_, _| {})?;
            let mut pick_time = Duration::ZERO;
            let mut finished = Vec::new();
            for (i, (s, mut l)) in slots.iter_mut().zip(logits).enumerate() {
                let t1 = Instant::now();
                let tok = s.picker.pick(&mut l)?;
                pick_time += t1.elapsed();
                s.last = tok;
                if !eos.contains(&tok) {
                    s.out.push(tok);
                }
                if eos.contains(&tok) || s.picker.finished() || s.out.len() > 512 {
                    finished.push(i);
                }
            }
            steps.push(t0.elapsed().as_secs_f64() * 1e3);
            if constrained {
                mask += pick_time;
                masked += slots.len();
            }
            // Restart finished sequences outside the timed step.
            for i in finished {
                let s = &slots[i];
                done += 1;
                let text = engine.tokenizer.decode(&s.out, true)?;
                valid += usize::from(serde_json::from_str::<serde_json::Value>(&text).is_ok());
                engine.release(s.seq)?;
                slots[i] = start(&mut engine, &grammars, constrained.then_some(&grammar), &prompt, a.temperature, (round * 1000 + i) as u64)?;
            }
        }
        for s in slots {
            engine.release(s.seq)?;
        }
        if constrained {
            report("constrained", &steps, mask, masked, done, valid);
            cons_all.extend(steps);
        } else {
            report("free", &steps, Duration::ZERO, 0, done, 0);
            free_all.extend(steps);
        }
    }
    let (f, c) = (percentile(&free_all, 0.5), percentile(&cons_all, 0.5));
    println!("{}", serde_json::json!({"bench": "grammar", "summary": true, "batch": a.batch, "tpot_ms_p50_free": f, "tpot_ms_p50_constrained": c, "overhead_pct": (c / f - 1.0) * 100.0}));
    Ok(())
}

/// A fresh sequence prefilled with `prompt`, its first token chosen (under `grammar` when given;
/// `salt` seeds a sampled run).
fn start(engine: &mut Engine, grammars: &Grammars, grammar: Option<&OutputGrammar>, prompt: &[u32], temperature: f32, salt: u64) -> anyhow::Result<Slot> {
    let params = SamplingParams { temperature, seed: Some(salt), ..SamplingParams::greedy(512) };
    let constraint = grammar.map(|g| grammars.constraint(g, &[])).transpose()?;
    let mut picker = Picker::new(Sampler::new(&params), constraint);
    let seq = engine.new_sequence();
    let mut logits = engine.prefill(seq, prompt)?;
    let last = picker.pick(&mut logits)?;
    Ok(Slot { seq, picker, last, out: vec![last] })
}

fn percentile(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() - 1) as f64 * q).round() as usize]
}
