//! `ferry plan --measured` on recorded inputs whose predictions and errors are worked out by hand:
//! a profile whose steps cost exactly 1 ms a prompt token (prefill) and 10 ms (decode, whatever
//! the batch and context), one request per rate of a fixed 100-token prompt and 11 output tokens,
//! on one colocated worker. The simulator then predicts, for every rate, TTFT = 100 × 1 ms =
//! 100 ms and TPOT = 10 ms (ten decode steps after the first token), every request within the
//! SLOs (500 ms, 50 ms): attainment 1, goodput = the rate.

use super::*;
use clap::Parser;
use crate::loadgen::Sample;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    plan: PlanArgs,
}

/// Writes the recorded inputs under a fresh directory: (dir, profile, serve result).
fn recorded(name: &str, runs: serde_json::Value) -> (PathBuf, PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("ferry-plan-measured-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prefill: Vec<_> = [(1, 32), (1, 128), (2, 64), (4, 256)]
        .iter()
        .map(|&(p, n)| serde_json::json!({ "prompts": p, "prompt_tokens": n, "seconds": 0.001 * (p * n) as f64 }))
        .collect();
    let decode: Vec<_> = [(1, 64), (2, 64), (4, 64), (1, 384), (2, 384), (4, 384)]
        .iter()
        .map(|&(b, c)| serde_json::json!({ "batch": b, "context": c, "seconds": 0.01 }))
        .collect();
    let profile = serde_json::json!({
        "format": PROFILE_FORMAT, "model": "hand-worked", "fingerprint": "0", "machine": "none", "threads": 1,
        "measured_at": "2026-12-05T00:00:00Z", "block_size": 16, "kv_blocks": 4096, "max_batch_tokens": 2048,
        "max_context": 8192, "kv_bytes_per_token": 1024, "prefill": prefill, "decode": decode,
    });
    let serve = serde_json::json!({
        "bench": "serve",
        "workload": { "requests_per_rate": 1, "prompt_len": "100", "output_len": "11", "seed": 3 },
        "slo": { "ttft_ms": 500.0, "tpot_ms": 50.0 },
        "runs": runs,
    });
    let (p, s) = (dir.join("profile.json"), dir.join("serve-1c.json"));
    std::fs::write(&p, profile.to_string()).unwrap();
    std::fs::write(&s, serve.to_string()).unwrap();
    (dir, p, s)
}

fn args(profile: &Path, measured: &str) -> PlanArgs {
    Cli::parse_from(["plan", "--profile", profile.to_str().unwrap(), "--measured", measured]).plan
}

fn close(got: f64, want: f64) -> bool {
    (got - want).abs() < 1e-6
}

#[test]
fn measured_cells_have_the_hand_worked_errors() {
    let runs = serde_json::json!([
        // TTFT measured 125 ms: (100 - 125) / 125 = -20% (outside 15%); the rest exact.
        { "rate": 1.0, "slo_attainment": 1.0, "ttft_ms": { "p90": 125.0 }, "tpot_ms": { "p90": 10.0 } },
        // (100 - 92) / 92 = +8.70%, (10 - 11.5) / 11.5 = -13.04%, goodput 2 / 2: all within.
        // The workers ran at twice the profile's step time: at that speed TTFT 200 ms, TPOT 20 ms,
        // errors (200 - 92) / 92 = +117.39% and (20 - 11.5) / 11.5 = +73.91%.
        { "rate": 2.0, "slo_attainment": 1.0, "ttft_ms": { "p90": 92.0 }, "tpot_ms": { "p90": 11.5 },
          "step_time": { "colocated": { "ratio": 2.0 } } },
        // Half the requests met the SLOs: goodput measured 2, predicted 4: +100%. Its one request
        // took 150 ms to its first token and 12 ms a token after: ratios 1.5 and 1.2.
        { "rate": 4.0, "slo_attainment": 0.5, "ttft_ms": { "p90": 100.0 }, "tpot_ms": { "p90": 10.0 },
          "samples": [{ "prompt_tokens": 100, "ttft_ms": 150.0, "tpot_ms": 12.0 }] },
    ]);
    let (dir, profile, serve) = recorded("errors", runs);
    let (cells, calibrated) = validated_cells(&args(&profile, &format!("1c={}", serve.display()))).unwrap();
    assert_eq!(cells.len(), 3);
    for c in &cells {
        assert!(close(c.predicted.ttft_p90_ms, 100.0) && close(c.predicted.tpot_p90_ms, 10.0), "the hand-worked prediction at {}/s: {:?}", c.rate, c.predicted);
        assert!(close(c.predicted_goodput, c.rate), "{:?}", c.predicted);
    }
    let errors: Vec<(f64, f64, f64)> = cells.iter().map(|c| (c.error_goodput, c.error_ttft_p90, c.error_tpot_p90)).collect();
    let want = [(0.0, -0.2, 0.0), (0.0, 8.0 / 92.0, -1.5 / 11.5), (1.0, 0.0, 0.0)];
    for (got, want) in errors.iter().zip(want) {
        assert!(close(got.0, want.0) && close(got.1, want.1) && close(got.2, want.2), "errors {got:?}, worked out by hand {want:?}");
    }
    assert_eq!(hits(&cells), 1, "only the 2/s cell is within 15% on all three: {errors:?}");
    let (ttft, tpot) = (cells[2].ttft_ratio_p50.expect("requests recorded at 4/s"), cells[2].tpot_ratio_p50.expect("requests recorded at 4/s"));
    assert!(close(ttft, 1.5) && close(tpot, 1.2), "per-request ratios {ttft} {tpot}, by hand 150 / 100 and 12 / 10");
    assert_eq!((cells[0].ttft_ratio_p50, cells[0].tpot_ratio_p50), (None, None), "no requests recorded at 1/s");
    // Only the 2/s run recorded its step time: one cell predicted again at that speed.
    assert_eq!(calibrated.len(), 1);
    let c = &calibrated[0];
    assert_eq!((c.rate, c.calibration.colocated), (2.0, 2.0));
    assert!(close(c.predicted.ttft_p90_ms, 200.0) && close(c.predicted.tpot_p90_ms, 20.0), "{:?}", c.predicted);
    assert!(close(c.error_ttft_p90, 108.0 / 92.0) && close(c.error_tpot_p90, 8.5 / 11.5), "{} {}", c.error_ttft_p90, c.error_tpot_p90);
    let report = validation_report(&cells, &calibrated);
    assert_eq!((report["within_15_percent"].as_u64(), report["of"].as_u64()), (Some(1), Some(3)), "{report}");
    assert_eq!(report["at_measured_step_time"]["within_15_percent"].as_u64(), Some(0), "{report}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn recorded_requests_of_another_workload_are_refused() {
    // The recorded request had 120 prompt tokens; the workload's has 100.
    let runs = serde_json::json!([{ "rate": 1.0, "slo_attainment": 1.0, "ttft_ms": { "p90": 100.0 }, "tpot_ms": { "p90": 10.0 },
        "samples": [{ "prompt_tokens": 120, "ttft_ms": 100.0, "tpot_ms": 10.0 }] }]);
    let (dir, profile, serve) = recorded("other", runs);
    let e = validated_cells(&args(&profile, &format!("1c={}", serve.display()))).err().expect("refused");
    assert!(format!("{e:#}").contains("request 0 at rate 1.0 had 120 prompt tokens, the workload's has 100"), "{e:#}");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn sample(ok: bool, ttft_ms: f64, tpot_ms: f64) -> Sample {
    Sample { ok, ttft_ms, tpot_ms, e2e_ms: 0.0, output_tokens: 2 }
}

#[test]
fn per_request_ratios_are_medians_of_measured_over_predicted() {
    let path = Path::new("run.json");
    let simulated: Vec<SimRequest> = [10, 20, 30, 40].iter().map(|&n| SimRequest { at: 0.0, prompt: n, output: 2 }).collect();
    // Predicted: the third failed (not counted), the fourth has no TPOT (one token: not counted
    // for TPOT).
    let predicted = [sample(true, 100.0, 10.0), sample(true, 50.0, 20.0), sample(false, 10.0, 10.0), sample(true, 40.0, 0.0)];
    let run = serde_json::json!({ "rate": 2.0, "samples": [
        { "prompt_tokens": 10, "ttft_ms": 200.0, "tpot_ms": 15.0 },
        { "prompt_tokens": 20, "ttft_ms": 25.0, "tpot_ms": 20.0 },
        { "prompt_tokens": 30, "ttft_ms": 999.0, "tpot_ms": 999.0 },
        { "ttft_ms": 40.0, "tpot_ms": 7.0 },
    ]});
    // TTFT ratios 2.0, 0.5, 1.0: median 1.0. TPOT ratios 1.5, 1.0: median 1.25.
    let (ttft, tpot) = per_request_ratios(&run, &simulated, &predicted, path).unwrap().expect("requests recorded");
    assert!(close(ttft, 1.0) && close(tpot, 1.25), "{ttft} {tpot}");
    assert_eq!(per_request_ratios(&serde_json::json!({ "rate": 2.0 }), &simulated, &predicted, path).unwrap(), None);
    let short = serde_json::json!({ "rate": 2.0, "samples": [{ "ttft_ms": 1.0 }] });
    let e = per_request_ratios(&short, &simulated, &predicted, path).unwrap_err();
    assert!(format!("{e:#}").contains("1 requests recorded at rate 2.0, the workload has 4"), "{e:#}");
}

fn cell(goodput: f64, ttft: f64, tpot: f64) -> Cell {
    let s = Summary { requests: 1, failed: 0, ttft_p50_ms: 0.0, ttft_p90_ms: 0.0, ttft_p99_ms: 0.0, tpot_p50_ms: 0.0, tpot_p90_ms: 0.0, tpot_p99_ms: 0.0, attainment: 1.0, tokens_per_s: 0.0 };
    Cell {
        split: "1c".into(),
        rate: 1.0,
        predicted: s,
        predicted_goodput: 1.0,
        measured_goodput: 1.0,
        measured_ttft_p90_ms: 0.0,
        measured_tpot_p90_ms: 0.0,
        measured_attainment: 1.0,
        error_goodput: goodput,
        error_ttft_p90: ttft,
        error_tpot_p90: tpot,
        ttft_ratio_p50: None,
        tpot_ratio_p50: None,
        calibration: Calibration::PROFILED,
        colocated: true,
    }
}

#[test]
fn a_hit_is_within_15_percent_on_all_three() {
    // 15% exactly is within, either side; 15.1% on any one is not; NaN (a prediction against a
    // measured 0) is not.
    let cells = [
        cell(0.15, -0.15, 0.0),
        cell(0.0, 0.0, 0.0),
        cell(0.151, 0.0, 0.0),
        cell(0.0, -0.151, 0.0),
        cell(0.0, 0.0, 0.151),
        cell(f64::NAN, 0.0, 0.0),
    ];
    assert_eq!(hits(&cells), 2);
    assert_eq!(hits(&[]), 0);
    assert!(relative_error(0.0, 0.0) == 0.0 && relative_error(1.0, 0.0).is_nan() && close(relative_error(3.0, 4.0), -0.25));
}
