//! Compile every kernel with NVRTC through the backend's own code path, without a GPU:
//! `scripts/check_kernels.sh` runs this (ignored by default: it needs `libnvrtc.so` on
//! `LD_LIBRARY_PATH`) and then assembles the PTX with ptxas.
//!
//! Environment: `FERRY_KERNEL_ARCH` (default `compute_90`), `FERRY_KERNEL_PTX_DIR` (where to write
//! `<file>.ptx`; nothing is written without it), `FERRY_CUDA_INCLUDE` (include directories).
#![cfg(feature = "cuda")]

use ferry_engine::backend::cuda::kernels::KERNELS;
use ferry_engine::backend::cuda::nvrtc::{CompileOptions, compile, compile_uncached, nvrtc_present, nvrtc_version};

#[test]
#[ignore = "needs libnvrtc.so; run by scripts/check_kernels.sh"]
fn compile_every_kernel() {
    assert!(nvrtc_present(), "libnvrtc.so could not be loaded (set LD_LIBRARY_PATH to the nvidia-cuda-nvrtc-cu12 wheel's lib/)");
    let (major, minor) = nvrtc_version().expect("nvrtcVersion");
    let arch = std::env::var("FERRY_KERNEL_ARCH").unwrap_or_else(|_| "compute_90".into());
    let out = std::env::var_os("FERRY_KERNEL_PTX_DIR").map(std::path::PathBuf::from);
    let opts = CompileOptions { disk_cache: false, ..CompileOptions::for_arch(arch.clone()) };
    println!("NVRTC {major}.{minor}, --gpu-architecture={arch}, include {:?}", opts.include_dirs);
    let mut failures = Vec::new();
    for k in KERNELS {
        match compile_uncached(k, &opts) {
            Ok(ptx) => {
                println!("ok   {:<16} {} kernels, {} bytes of PTX", k.file, k.functions.len(), ptx.len());
                if let Some(dir) = &out {
                    std::fs::create_dir_all(dir).expect("create the PTX directory");
                    std::fs::write(dir.join(k.file.replace(".cu", ".ptx")), ptx).expect("write PTX");
                }
            }
            Err(e) => {
                println!("FAIL {}: {e}", k.file);
                failures.push(k.file);
            }
        }
    }
    assert!(failures.is_empty(), "kernels that do not compile: {failures:?}");

    // The backend's cached path: the PTX lands in <FERRY_CACHE>/kernels and is the same text.
    let cache = std::env::temp_dir().join(format!("ferry-kernel-cache-{}", std::process::id()));
    // SAFETY: this binary's only test runs on this thread; nothing else reads the environment now.
    unsafe { std::env::set_var("FERRY_CACHE", &cache) };
    let k = &KERNELS[0];
    let cached = compile(k, &CompileOptions { disk_cache: true, ..opts.clone() }).expect("compile with the cache");
    assert_eq!(cached, compile_uncached(k, &opts).unwrap(), "cached PTX differs");
    let files: Vec<_> = std::fs::read_dir(cache.join("kernels")).expect("the kernel cache directory").filter_map(|e| e.ok()).collect();
    assert_eq!(files.len(), 1, "one PTX file cached for {}", k.file);
    assert_eq!(std::fs::read_to_string(files[0].path()).unwrap(), cached);
    println!("cache  {} -> {}", k.file, files[0].path().display());
    let _ = std::fs::remove_dir_all(cache);
}
