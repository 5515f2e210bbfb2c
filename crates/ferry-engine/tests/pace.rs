//! `Engine::pace` (a worker's `--emulate-profile`): every step lasts at least what the cost model
//! says for its shape — decode rows with their contexts, prompt chunks with what they attend —
//! and computes exactly what an unpaced engine does.

mod common;
use common::*;
use ferry_core::profile::{CostModel, DecodePoint, PrefillPoint, Profile, PROFILE_FORMAT};
use ferry_engine::{Engine, EngineConfig, Logits, StepItem};
use std::time::{Duration, Instant};

fn engine() -> Engine {
    let cfg = EngineConfig { threads: 1, device: test_device(), kv_tokens: Some(512), ..Default::default() };
    Engine::load(&golden_dir("llama-gqa"), &cfg).expect("load model")
}

/// A device far slower than the tiny model on any CPU: prefill 40 ms + 1 ms a token, decode
/// 200 ms + 5 ms a row (and a little per context token).
fn model() -> CostModel {
    let prefill = [(1, 16), (1, 64), (2, 64)].map(|(prompts, n)| PrefillPoint { prompts, prompt_tokens: n, seconds: 0.040 + 0.001 * (prompts * n) as f64 });
    let decode = [(1, 16), (4, 16), (1, 128), (4, 128)].map(|(batch, context)| DecodePoint { batch, context, seconds: 0.200 + 0.005 * batch as f64 + 1e-6 * (batch * context) as f64 });
    let p = Profile {
        format: PROFILE_FORMAT,
        model: "slow device".into(),
        fingerprint: String::new(),
        machine: "written by the test".into(),
        threads: 1,
        measured_at: "2026-12-03T00:00:00Z".into(),
        block_size: 16,
        kv_blocks: 32,
        max_batch_tokens: 2048,
        max_context: 512,
        kv_bytes_per_token: 1024,
        kv_dtype: Default::default(),
        prefill: prefill.to_vec(),
        decode: decode.to_vec(),
    };
    CostModel::fit(&p).expect("fit")
}

/// Seconds of one step of `items`, and its logits.
fn timed(e: &mut Engine, items: &[StepItem]) -> (Duration, Vec<Vec<f32>>) {
    let t = Instant::now();
    let out = e.step(items, &mut |_, _| {}).expect("step");
    (t.elapsed(), out)
}

#[test]
fn paced_steps_last_what_the_profile_says_and_compute_the_same() {
    let m = model();
    let (mut paced, mut plain) = (engine(), engine());
    paced.pace(Some(m));
    let prompt: Vec<u32> = (1..=40).collect();
    let (a, b) = (paced.new_sequence(), paced.new_sequence());
    let (pa, pb) = (plain.new_sequence(), plain.new_sequence());
    let at_least = |d: Duration, s: f64, what: &str| assert!(d.as_secs_f64() >= s, "{what}: {d:?}, the model says {s} s");

    // Two prompts in one step: one chunk each, attending their own tokens.
    let items = |x, y| [StepItem { seq: x, tokens: &prompt, logits: Logits::Last }, StepItem { seq: y, tokens: &prompt[..20], logits: Logits::Last }];
    let (d, out) = timed(&mut paced, &items(a, b));
    at_least(d, m.step(0, 0, &[(0, 40), (0, 20)]), "a prefill step of 40 + 20 tokens");
    assert_eq!(out, timed(&mut plain, &items(pa, pb)).1, "pacing changed what the step computed");

    // Both decode a token: two rows holding 40 and 20 tokens.
    let tok = [7u32];
    let items = |x, y| [StepItem { seq: x, tokens: &tok, logits: Logits::Last }, StepItem { seq: y, tokens: &tok, logits: Logits::Last }];
    let (d, out) = timed(&mut paced, &items(a, b));
    at_least(d, m.step(2, 60, &[]), "a decode step of 2 rows");
    assert_eq!(out, timed(&mut plain, &items(pa, pb)).1);

    // A continued prompt (a chunk after 21 tokens) riding with a decode row.
    let mixed = |x, y| [StepItem { seq: x, tokens: &tok, logits: Logits::Last }, StepItem { seq: y, tokens: &prompt[20..30], logits: Logits::Last }];
    let (d, _) = timed(&mut paced, &mixed(a, b));
    at_least(d, m.step(1, 41, &[(21, 10)]), "a mixed step");
    assert!(m.step(1, 41, &[(21, 10)]) > m.step(0, 0, &[(0, 10)]), "the mixed step prices its decode row and the attended prefix");

    // Unpaced again: the tiny model's step takes far less than the slow device's.
    paced.pace(None);
    let (d, _) = timed(&mut paced, &[StepItem { seq: a, tokens: &tok, logits: Logits::Last }]);
    assert!(d.as_secs_f64() < m.step(1, 42, &[]), "pace(None) still paced: {d:?}");
    for s in [a, b] {
        paced.release(s).unwrap();
    }
    for s in [pa, pb] {
        plain.release(s).unwrap();
    }
}

/// `Engine::price`: every step is counted with what it took and what the model says its shape
/// costs on the profiled device, without changing how long it takes; a paced engine is priced
/// against its pacing model.
#[test]
fn priced_steps_add_up_what_they_took_and_what_the_profile_says() {
    let m = model();
    let mut e = engine();
    assert_eq!(e.clock(), ferry_engine::StepClock::default());
    let prompt: Vec<u32> = (1..=40).collect();
    let s = e.new_sequence();
    e.step(&[StepItem { seq: s, tokens: &prompt, logits: Logits::Last }], &mut |_, _| {}).unwrap();
    assert_eq!(e.clock().steps, 0, "nothing prices the steps yet");

    e.price(Some(m));
    let tok = [7u32];
    let (d, _) = timed(&mut e, &[StepItem { seq: s, tokens: &tok, logits: Logits::Last }]);
    let (d2, _) = timed(&mut e, &[StepItem { seq: s, tokens: &prompt[..8], logits: Logits::Last }]);
    let c = e.clock();
    assert_eq!(c.steps, 2);
    let want = m.step(1, 40, &[]) + m.step(0, 0, &[(41, 8)]);
    assert!((c.model_seconds - want).abs() < 1e-12, "priced {} s, the model says {want} s", c.model_seconds);
    assert!(c.seconds > 0.0 && c.seconds <= (d + d2).as_secs_f64(), "counted {} s of steps that took {:?}", c.seconds, d + d2);
    assert!(c.seconds < c.model_seconds, "pricing paced the steps: {} s against {} s", c.seconds, c.model_seconds);

    // Paced and not priced otherwise: priced against the pacing model, never faster than it.
    let mut p = engine();
    p.pace(Some(m));
    let q = p.new_sequence();
    timed(&mut p, &[StepItem { seq: q, tokens: &prompt, logits: Logits::Last }]);
    let c = p.clock();
    assert_eq!(c.steps, 1);
    assert!((c.model_seconds - m.step(0, 0, &[(0, 40)])).abs() < 1e-12 && c.seconds >= c.model_seconds, "{c:?}");
    e.release(s).unwrap();
    p.release(q).unwrap();
}
