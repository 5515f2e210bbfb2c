//! `ferry bench grammar --router ADDR`: does a router under a steady trickle of the worst grammar
//! it accepts still serve normal traffic at its usual TTFT (issue 32)?
//!
//! First each candidate grammar near the limits (the longest Lark chain, the most choices, the
//! deepest schema, the largest repetition) is sent once and timed; the slowest one the router
//! accepts is "the worst accepted grammar". Then phases alternate, without and with that grammar
//! sent `hostile_rps` times a second (max 1 token each) beside a closed loop of normal requests,
//! one at a time; each phase reports the normal requests' TTFT p50/p99, and a summary compares
//! the two modes over all their phases.

use std::time::{Duration, Instant};

use ferry_proto::v1::{self, generate_request, structured_output::Kind};
use tonic::transport::Channel;

type Client = v1::ferry_client::FerryClient<Channel>;

const PROMPT: &str = "Write one sentence about rivers.";

/// Grammars at (just under) each limit of `ferry_grammar::Limits::default()`.
fn candidates() -> Vec<(&'static str, Kind)> {
    let mut chain = String::from("start: r1\n");
    for i in 1..511 {
        chain += &format!("r{i}: \"x{i}\" | r{}\n", i + 1);
    }
    chain += "r511: \"x511\"\n";
    let choices = (0..1024).map(|i| format!("{i:04} the quick brown fox jumps over the lazy dog {i:04}")).collect();
    let mut schema = r#"{"type":"string"}"#.to_string();
    for i in 0..30 {
        schema = format!(r#"{{"type":"object","properties":{{"k{i}":{schema},"n{i}":{{"type":"integer"}}}},"required":["k{i}","n{i}"]}}"#);
    }
    vec![
        ("lark_chain_511_rules", Kind::Lark(chain)),
        ("choice_1024", Kind::Choice(v1::Choices { choices })),
        ("json_schema_depth_30", Kind::JsonSchema(schema)),
        ("regex_repetition_9900", Kind::Regex("([a-z0-9]{100}-){99}".into())),
    ]
}

fn request(grammar: Option<Kind>, max_tokens: u32) -> v1::GenerateRequest {
    v1::GenerateRequest {
        input: Some(generate_request::Input::Prompt(PROMPT.into())),
        sampling: grammar.map(|k| v1::SamplingParams { structured: Some(v1::StructuredOutput { kind: Some(k) }), ..Default::default() }),
        stop: Some(v1::StopConditions { max_tokens, ..Default::default() }),
        ..Default::default()
    }
}

/// Sends `req`; returns the time to its first token (or to its answer when it has none) and
/// whether it succeeded.
async fn send(c: &mut Client, req: v1::GenerateRequest) -> (Duration, Result<(), tonic::Status>) {
    let t0 = Instant::now();
    let mut stream = match c.generate(req).await {
        Ok(s) => s.into_inner(),
        Err(s) => return (t0.elapsed(), Err(s)),
    };
    let mut first = None;
    loop {
        match stream.message().await {
            Ok(Some(m)) => {
                if matches!(m.event, Some(v1::generate_response::Event::Delta(_))) && first.is_none() {
                    first = Some(t0.elapsed());
                }
            }
            Ok(None) => return (first.unwrap_or_else(|| t0.elapsed()), Ok(())),
            Err(s) => return (first.unwrap_or_else(|| t0.elapsed()), Err(s)),
        }
    }
}

fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() - 1) as f64 * q).round() as usize]
}

pub fn run(router: &str, phase_seconds: u64, phases: usize, hostile_rps: f64) -> anyhow::Result<()> {
    anyhow::ensure!(phases >= 2 && hostile_rps > 0.0, "--phases must be at least 2 and --hostile-rps above 0");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{router}"))?.connect().await?;
        let mut c = Client::new(ch.clone());
        // Warm up: the router's and workers' grammar engines are built on first use.
        let _ = send(&mut c, request(Some(Kind::Regex("[a-z]+".into())), 1)).await;
        let mut worst: Option<(&str, Kind, f64)> = None;
        for (name, kind) in candidates() {
            let (took, r) = send(&mut c, request(Some(kind.clone()), 1)).await;
            let ms = took.as_secs_f64() * 1e3;
            let status = r.as_ref().map_or_else(|s| format!("{:?}: {}", s.code(), s.message()), |_| "ok".into());
            println!("{}", serde_json::json!({"bench": "grammar_load", "candidate": name, "ms": ms, "status": status}));
            if r.is_ok() && worst.as_ref().is_none_or(|w| ms > w.2) {
                worst = Some((name, kind, ms));
            }
        }
        let (worst_name, worst_kind, _) = worst.ok_or_else(|| anyhow::anyhow!("the router accepted none of the candidate grammars"))?;
        let (mut off, mut on) = (Vec::new(), Vec::new());
        let (mut hostile_ms, mut hostile_failed) = (Vec::new(), 0usize);
        for phase in 0..phases {
            let loaded = phase % 2 == 1;
            let end = Instant::now() + Duration::from_secs(phase_seconds);
            let hostile = loaded.then(|| {
                let (ch, kind) = (ch.clone(), worst_kind.clone());
                tokio::spawn(async move {
                    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / hostile_rps));
                    let mut sent = Vec::new();
                    while Instant::now() < end {
                        tick.tick().await;
                        let (mut c, kind) = (Client::new(ch.clone()), kind.clone());
                        sent.push(tokio::spawn(async move { send(&mut c, request(Some(kind), 1)).await }));
                    }
                    let mut out = Vec::new();
                    for s in sent {
                        if let Ok((took, r)) = s.await {
                            out.push((took.as_secs_f64() * 1e3, r.is_ok()));
                        }
                    }
                    out
                })
            });
            let mut ttft = Vec::new();
            while Instant::now() < end {
                let (took, r) = send(&mut c, request(None, 4)).await;
                r.map_err(|s| anyhow::anyhow!("a normal request failed: {:?}: {}", s.code(), s.message()))?;
                ttft.push(took.as_secs_f64() * 1e3);
            }
            if let Some(h) = hostile {
                for (ms, ok) in h.await? {
                    hostile_ms.push(ms);
                    hostile_failed += usize::from(!ok);
                }
            }
            let mode = if loaded { "with_hostile_grammar" } else { "without" };
            println!("{}", serde_json::json!({"bench": "grammar_load", "phase": phase, "mode": mode, "requests": ttft.len(),
                "ttft_ms_p50": percentile(&ttft, 0.5), "ttft_ms_p99": percentile(&ttft, 0.99)}));
            if loaded { on.extend(ttft) } else { off.extend(ttft) }
        }
        println!("{}", serde_json::json!({"bench": "grammar_load", "summary": true, "worst_accepted_grammar": worst_name,
            "hostile_rps": hostile_rps, "hostile_sent": hostile_ms.len(), "hostile_failed": hostile_failed,
            "hostile_ms_p50": percentile(&hostile_ms, 0.5),
            "without": {"requests": off.len(), "ttft_ms_p50": percentile(&off, 0.5), "ttft_ms_p99": percentile(&off, 0.99)},
            "with_hostile_grammar": {"requests": on.len(), "ttft_ms_p50": percentile(&on, 0.5), "ttft_ms_p99": percentile(&on, 0.99)}}));
        anyhow::Ok(())
    })
}
