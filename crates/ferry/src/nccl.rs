//! KV over NCCL for GPU workers: the CUDA backend's [`NcclPipe`] behind `ferry-worker`'s pipe
//! traits. Workers get pipes with `--kv-transport nccl --device cuda[:N]`; anything else (a CPU
//! worker, a build without `cuda`, no libnccl) keeps the host transports, with a warning.

use ferry_worker::kv::pipe::{PipeConnector, Pipes};
#[cfg(feature = "cuda")]
use ferry_engine::KvBuffer;
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

    /// A layer on this GPU goes device to device, with no host copy on either side. (Host
    /// bytes, which a GPU worker does not produce, go through a device buffer of their own, so
    /// each frame is still one message of its full size.)
    fn send_buffer(&mut self, buf: &KvBuffer, range: std::ops::Range<usize>, deadline: std::time::Instant) -> Result<(), String> {
        match buf {
            KvBuffer::Cuda(d) => self.0.send_device(d, range, deadline),
            KvBuffer::Host(_) => {
                let mut staged = KvBuffer::Cuda(self.0.alloc(range.len())?);
                staged.write(0, &buf.to_host(range).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
                self.send_buffer(&staged, 0..staged.len(), deadline)
            }
        }
    }

    fn recv_buffer(&mut self, buf: &mut KvBuffer, range: std::ops::Range<usize>, deadline: std::time::Instant) -> Result<(), String> {
        match buf {
            KvBuffer::Cuda(d) => self.0.recv_device(d, range, deadline),
            KvBuffer::Host(_) => {
                let mut staged = KvBuffer::Cuda(self.0.alloc(range.len())?);
                self.recv_buffer(&mut staged, 0..range.len(), deadline)?;
                buf.write(range.start, &staged.to_host(0..range.len()).map_err(|e| e.to_string())?).map_err(|e| e.to_string())
            }
        }
    }

    /// The payload body is received on this GPU, where the decode engine scatters it from.
    fn alloc_buffer(&mut self, len: usize) -> Result<KvBuffer, String> {
        self.0.alloc(len).map(KvBuffer::Cuda)
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
        let capacity = ferry_worker::kv::MAX_CHUNK_BYTES.max(ferry_worker::kv::frame::HEADER_BYTES);
        let pipe = ferry_engine::backend::cuda::nccl::NcclPipe::connect(self.ordinal, id, rank, timeout, capacity)?;
        Ok(Box::new(Pipe(pipe)))
    }

    fn device(&self) -> u32 {
        self.ordinal as u32
    }
}
