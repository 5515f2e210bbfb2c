//! Opening a CUDA device without ever letting cudarc panic: each library is checked for presence
//! before its first call (cudarc's dynamic loading panics on a missing library), and every driver
//! failure becomes an [`EngineError`] that names the device and the cause.

use crate::error::{EngineError, Result};
use cudarc::driver::{CudaContext, DriverError, sys};
use std::sync::Arc;

/// The driver, NVRTC and cuBLAS, each with what to install when it is missing.
fn missing_library() -> Option<&'static str> {
    // SAFETY: each call only tries to dlopen a library by name; nothing in it is called.
    unsafe {
        if !cudarc::driver::sys::is_culib_present() {
            return Some("libcuda.so (the NVIDIA driver) could not be loaded: this machine has no NVIDIA driver");
        }
        if !cudarc::nvrtc::sys::is_culib_present() {
            return Some("libnvrtc.so (NVRTC, to compile the kernels) could not be loaded: install the CUDA toolkit or the nvidia-cuda-nvrtc-cu12 wheel and put its lib/ on LD_LIBRARY_PATH");
        }
        if !cudarc::cublas::sys::is_culib_present() {
            return Some("libcublas.so could not be loaded: install the CUDA toolkit or the nvidia-cublas-cu12 wheel and put its lib/ on LD_LIBRARY_PATH");
        }
    }
    None
}

/// A readable name for a driver error (`CUDA_ERROR_NO_DEVICE`, ...).
pub(crate) fn describe(e: &DriverError) -> String {
    match e.error_name() {
        Ok(name) => name.to_string_lossy().into_owned(),
        Err(_) => format!("{:?}", e.0),
    }
}

/// Open device `ordinal` (its primary context).
pub(crate) fn open(ordinal: usize) -> Result<Arc<CudaContext>> {
    let dev = format!("cuda:{ordinal}");
    if let Some(why) = missing_library() {
        return Err(EngineError::DeviceUnavailable(dev, why.into()));
    }
    let count = CudaContext::device_count().map_err(|e| match e.0 {
        sys::cudaError_enum::CUDA_ERROR_NO_DEVICE => EngineError::DeviceUnavailable(dev.clone(), "the NVIDIA driver reports no CUDA device (CUDA_ERROR_NO_DEVICE)".into()),
        _ => EngineError::DeviceUnavailable(dev.clone(), format!("the CUDA driver failed to initialize: {}", describe(&e))),
    })?;
    if ordinal >= count.max(0) as usize {
        return Err(EngineError::DeviceUnavailable(dev, format!("this machine has {count} CUDA device(s)")));
    }
    CudaContext::new(ordinal).map_err(|e| EngineError::DeviceUnavailable(dev, format!("cannot create a context: {}", describe(&e))))
}

/// Device `ordinal`'s 16-byte UUID (what `nvidia-smi -L` prints), to tell two processes on one GPU.
pub fn device_uuid(ordinal: usize) -> Result<[u8; 16]> {
    let ctx = open(ordinal)?;
    let fail = |what: &str, r: sys::CUresult| EngineError::DeviceUnavailable(format!("cuda:{ordinal}"), format!("{what}: {r:?}"));
    let mut uuid = sys::CUuuid { bytes: [0; 16] };
    // SAFETY: `ctx.cu_device()` is a valid device handle; the call writes 16 bytes.
    let r = unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, ctx.cu_device()) };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(fail("cuDeviceGetUuid", r));
    }
    Ok(std::array::from_fn(|i| uuid.bytes[i] as u8))
}
