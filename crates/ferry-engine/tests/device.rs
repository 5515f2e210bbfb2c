//! `--device cuda` fails with a clear error, never a panic: in a build without the `cuda` feature,
//! and (with it) on a machine without an NVIDIA driver or GPU, such as CI's.

use ferry_engine::backend::cuda::CudaBackend;
use ferry_engine::{Device, Engine, EngineConfig, EngineError};
use std::path::Path;

fn cuda_config() -> EngineConfig {
    EngineConfig { device: Device::Cuda(0), ..Default::default() }
}

/// The device is checked before the model is read: a missing file is not what the error says.
#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_without_the_feature_says_so() {
    let e = Engine::load(Path::new("/nonexistent/model.gguf"), &cuda_config()).err().expect("loading on cuda must fail in a CPU-only build");
    assert!(matches!(e, EngineError::CudaNotBuilt(_)), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("built without CUDA support") && msg.contains("--features cuda"), "{msg}");
    assert!(matches!(CudaBackend::new(1), Err(EngineError::CudaNotBuilt(d)) if d == "cuda:1"));
}

/// With the feature, on a machine with no driver (or no GPU): a `DeviceUnavailable` error naming
/// the cause. Where a GPU is present, the backend opens (and describes itself) instead.
#[cfg(feature = "cuda")]
#[test]
fn cuda_without_a_device_says_why() {
    match CudaBackend::new(0) {
        Ok(be) => println!("a CUDA device is present: {}", ferry_engine::backend::Backend::describe(&be)),
        Err(e) => {
            let msg = e.to_string();
            println!("no usable CUDA device here: {msg}");
            assert!(matches!(e, EngineError::DeviceUnavailable(ref d, _) if d == "cuda:0"), "{msg}");
            let e = Engine::load(Path::new("/nonexistent/model.gguf"), &cuda_config()).err().expect("no device: loading must fail");
            assert!(matches!(e, EngineError::DeviceUnavailable(..)), "the device error comes before the model is read: {e}");
        }
    }
    // An ordinal no machine has.
    let e = CudaBackend::new(4096).err().expect("there is no cuda:4096");
    assert!(matches!(e, EngineError::DeviceUnavailable(ref d, _) if d == "cuda:4096"), "{e}");
}

#[test]
fn devices_parse_and_errors_are_named() {
    assert_eq!("cuda:1".parse::<Device>().unwrap(), Device::Cuda(1));
    let e = "gpu:x".parse::<Device>().unwrap_err();
    assert!(e.to_string().contains("expected cpu, cuda or cuda:N"), "{e}");
}
