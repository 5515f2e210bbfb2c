//! KV over NCCL for GPU workers: the CUDA backend's [`NcclPipe`] behind `ferry-worker`'s pipe
//! traits. Workers get pipes with `--kv-transport nccl --device cuda[:N]`; anything else (a CPU
//! worker, a build without `cuda`, no libnccl) keeps the host transports, with a warning.

use ferry_worker::kv::pipe::{PipeConnector, Pipes};
#[cfg(feature = "cuda")]
use ferry_worker::kv::pipe::BytePipe;
use std::sync::Arc;

/// The pipes a worker asked for NCCL gets, or None with the reason logged.
pub fn pipes(device: ferry_engine::Device) -> Option<Pipes> {
    match connector(device) {
        Ok(c) => Some(Pipes(c)),
        Err(why) => {
            tracing::warn!("--kv-transport nccl: {why}; KV goes over the host transports (tcp, else grpc)");
            None
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn connector(_device: ferry_engine::Device) -> Result<Arc<dyn PipeConnector>, String> {
    Err("this build has no CUDA (rebuild with `--features cuda`)".into())
}

#[cfg(feature = "cuda")]
fn connector(device: ferry_engine::Device) -> Result<Arc<dyn PipeConnector>, String> {
    use ferry_engine::backend::cuda::nccl;
    let ferry_engine::Device::Cuda(ordinal) = device else {
        return Err("the worker runs on the CPU (NCCL needs --device cuda)".into());
    };
    if !nccl::nccl_present() {
        return Err("libnccl.so could not be loaded (install NCCL; with the nvidia-nccl-cu12 wheel, link libnccl.so to its lib/libnccl.so.2 and put both on LD_LIBRARY_PATH)".into());
    }
    Ok(Arc::new(Cuda { ordinal }))
}

#[cfg(feature = "cuda")]
struct Cuda {
    ordinal: usize,
}

#[cfg(feature = "cuda")]
struct Pipe(ferry_engine::backend::cuda::nccl::NcclPipe);

#[cfg(feature = "cuda")]
impl BytePipe for Pipe {
    fn send(&mut self, data: &[u8], deadline: std::time::Instant) -> Result<(), String> {
        self.0.send(data, deadline)
    }

    fn recv(&mut self, buf: &mut [u8], deadline: std::time::Instant) -> Result<(), String> {
        self.0.recv(buf, deadline)
    }
}

#[cfg(feature = "cuda")]
impl PipeConnector for Cuda {
    fn describe(&self) -> String {
        format!("nccl on cuda:{}", self.ordinal)
    }

    fn new_id(&self) -> Result<Vec<u8>, String> {
        ferry_engine::backend::cuda::nccl::unique_id()
    }

    fn connect(&self, id: &[u8], rank: u32, timeout: std::time::Duration) -> Result<Box<dyn BytePipe>, String> {
        let capacity = ferry_worker::kv::MAX_CHUNK_BYTES.max(ferry_worker::kv::pipe::HEADER_BYTES);
        let pipe = ferry_engine::backend::cuda::nccl::NcclPipe::connect(self.ordinal, id, rank, timeout, capacity)?;
        Ok(Box::new(Pipe(pipe)))
    }

    fn device(&self) -> u32 {
        self.ordinal as u32
    }
}
