//! Compiling the kernels with NVRTC (loaded at run time from `libnvrtc.so`): for a device, with
//! `--gpu-architecture=compute_XY`; for CI without a GPU, for any named architecture. PTX is
//! cached per process and on disk (`<ferry cache>/kernels/<file>-<hash>.ptx`, the hash over the
//! source, the options and the NVRTC version), so a restart does not recompile.

use super::kernels::{KERNELS, KernelSource};
use crate::error::{EngineError, Result};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

/// How to compile: the virtual architecture and extra include directories.
#[derive(Clone, Debug)]
pub struct CompileOptions {
    /// e.g. `compute_90`.
    pub arch: String,
    /// Include directories (the CUDA runtime headers); `FERRY_CUDA_INCLUDE` (colon-separated)
    /// adds more. The kernels include no headers today; the path is passed so they may.
    pub include_dirs: Vec<String>,
    /// Cache the PTX on disk.
    pub disk_cache: bool,
}

impl CompileOptions {
    pub fn for_arch(arch: impl Into<String>) -> Self {
        let include_dirs = std::env::var("FERRY_CUDA_INCLUDE").map(|v| v.split(':').filter(|s| !s.is_empty()).map(String::from).collect()).unwrap_or_default();
        Self { arch: arch.into(), include_dirs, disk_cache: true }
    }

    fn flags(&self) -> Vec<String> {
        vec![format!("--gpu-architecture={}", self.arch), "--std=c++17".into()]
    }
}

/// Whether `libnvrtc.so` can be loaded (cudarc panics on first use otherwise).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library by its candidate names; no symbol is called.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// NVRTC's version, `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    require_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present (checked above); nvrtcVersion writes two ints we own.
    let rc = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if rc != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(EngineError::Cuda { op: "nvrtcVersion".into(), reason: format!("{rc:?}") });
    }
    Ok((major, minor))
}

fn require_nvrtc() -> Result<()> {
    if nvrtc_present() {
        Ok(())
    } else {
        Err(EngineError::DeviceUnavailable(
            "cuda".into(),
            "libnvrtc.so (NVRTC, to compile the kernels) could not be loaded; install the CUDA toolkit or the nvidia-cuda-nvrtc-cu12 wheel and put its lib/ on LD_LIBRARY_PATH".into(),
        ))
    }
}

fn memory() -> &'static Mutex<HashMap<(String, &'static str), String>> {
    static PTX: OnceLock<Mutex<HashMap<(String, &'static str), String>>> = OnceLock::new();
    PTX.get_or_init(Default::default)
}

fn disk_path(k: &KernelSource, opts: &CompileOptions, version: (i32, i32)) -> PathBuf {
    let mut h = Sha256::new();
    h.update(k.source.as_bytes());
    for f in opts.flags().iter().chain(&opts.include_dirs) {
        h.update([0]);
        h.update(f.as_bytes());
    }
    h.update(format!("nvrtc {}.{}", version.0, version.1).as_bytes());
    let hex: String = h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect();
    let stem = k.file.trim_end_matches(".cu");
    crate::fetch::cache_dir().join("kernels").join(format!("{stem}-{}-{hex}.ptx", opts.arch))
}

/// The PTX of one kernel file: from this process's cache, the disk cache, or NVRTC.
pub fn compile(k: &'static KernelSource, opts: &CompileOptions) -> Result<String> {
    let key = (opts.arch.clone(), k.file);
    if let Some(p) = memory().lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return Ok(p.clone());
    }
    let version = nvrtc_version()?;
    let path = disk_path(k, opts, version);
    if opts.disk_cache
        && let Ok(p) = std::fs::read_to_string(&path)
        && p.contains(".entry")
    {
        memory().lock().unwrap_or_else(|e| e.into_inner()).insert(key, p.clone());
        return Ok(p);
    }
    let ptx = compile_uncached(k, opts)?;
    if opts.disk_cache {
        // Best effort: a read-only cache only costs a recompile next time.
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let written = path.parent().map(std::fs::create_dir_all).transpose().and_then(|_| std::fs::write(&tmp, &ptx)).and_then(|_| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            tracing::warn!("cannot cache kernel PTX at {}: {e}", path.display());
        }
    }
    memory().lock().unwrap_or_else(|e| e.into_inner()).insert(key, ptx.clone());
    Ok(ptx)
}

/// Compile with NVRTC, no cache; checks that every listed function is in the PTX.
pub fn compile_uncached(k: &KernelSource, opts: &CompileOptions) -> Result<String> {
    require_nvrtc()?;
    if k.source.contains('\0') {
        return Err(EngineError::KernelCompile { file: k.file.into(), log: "the source contains a NUL byte".into() });
    }
    let nv = cudarc::nvrtc::CompileOptions { options: opts.flags(), include_paths: opts.include_dirs.clone(), name: Some(k.file.to_string()), ..Default::default() };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(k.source, nv).map_err(|e| EngineError::KernelCompile {
        file: k.file.into(),
        log: match e {
            cudarc::nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => format!("{other:?}"),
        },
    })?;
    let text = match ptx.as_bytes() {
        Some(b) => String::from_utf8_lossy(b).trim_end_matches('\0').to_string(),
        None => return Err(EngineError::KernelCompile { file: k.file.into(), log: "NVRTC returned no PTX image".into() }),
    };
    for f in k.functions {
        if !text.contains(&format!(".entry {f}(")) {
            return Err(EngineError::KernelCompile { file: k.file.into(), log: format!("the PTX has no entry point {f}") });
        }
    }
    Ok(text)
}

/// Every kernel file's PTX, in [`KERNELS`] order.
pub fn compile_all(opts: &CompileOptions) -> Result<Vec<(&'static KernelSource, String)>> {
    KERNELS.iter().map(|k| Ok((k, compile(k, opts)?))).collect()
}
