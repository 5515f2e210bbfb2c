//! Device-to-device KV pipes for GPU workers, behind `ferry-worker`'s pipe traits: NCCL
//! (`--kv-transport nccl`, the CUDA backend's [`NcclPipe`]) and CUDA IPC between processes of one
//! node (`--kv-transport cuda-ipc`, [`IpcPipe`]). Anything else (a CPU worker, a build without
//! `cuda`, no libnccl) keeps the host transports, with a warning.
//!
//! [`NcclPipe`]: ferry_engine::backend::cuda::nccl::NcclPipe
//! [`IpcPipe`]: ferry_engine::backend::cuda::ipc::IpcPipe

use ferry_proto::v1::KvTransport;
use ferry_worker::kv::device::{PipeConnector, Pipes};
use std::sync::Arc;

/// The pipes of `kind` (`Nccl` or `CudaIpc`) a worker on `device` gets, or None with the reason
/// logged.
pub fn pipes(kind: KvTransport, device: ferry_engine::Device) -> Option<Pipes> {
    match connector(kind, device) {
        Ok(c) => Some(Pipes(c)),
        Err(why) => {
            tracing::warn!("--kv-transport {kind}: {why}; KV goes over the host transports (tcp, else grpc)");
            None
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn connector(_kind: KvTransport, _device: ferry_engine::Device) -> Result<Arc<dyn PipeConnector>, String> {
    Err("this build has no CUDA (rebuild with `--features cuda`)".into())
}

#[cfg(feature = "cuda")]
fn connector(kind: KvTransport, device: ferry_engine::Device) -> Result<Arc<dyn PipeConnector>, String> {
    use ferry_engine::backend::cuda::nccl;
    let ferry_engine::Device::Cuda(ordinal) = device else {
        return Err("the worker runs on the CPU (device pipes need --device cuda)".into());
    };
    match kind {
        KvTransport::Nccl if !nccl::nccl_present() => {
            Err("libnccl.so could not be loaded (install NCCL; with the nvidia-nccl-cu12 wheel, link libnccl.so to its lib/libnccl.so.2 and put both on LD_LIBRARY_PATH)".into())
        }
        KvTransport::Nccl | KvTransport::CudaIpc => Ok(Arc::new(cuda::Connector { ordinal, kind, uuid: ferry_engine::backend::cuda::device_uuid(ordinal).ok() })),
        other => Err(format!("{other} is not a device pipe")),
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use ferry_engine::backend::cuda::{ipc::IpcPipe, nccl::NcclPipe};
    use ferry_engine::KvBuffer;
    use ferry_proto::v1::KvTransport;
    use ferry_worker::kv::device::{BytePipe, PipeConnector};
    use std::ops::Range;
    use std::time::{Duration, Instant};

    pub(super) struct Connector {
        pub(super) ordinal: usize,
        pub(super) kind: KvTransport,
        /// The device's UUID, read once (None if the driver would not say).
        pub(super) uuid: Option<[u8; 16]>,
    }

    impl PipeConnector for Connector {
        fn describe(&self) -> String {
            format!("{} on cuda:{}", self.kind, self.ordinal)
        }

        fn transport(&self) -> KvTransport {
            self.kind
        }

        fn new_id(&self) -> Result<Vec<u8>, String> {
            match self.kind {
                KvTransport::CudaIpc => ferry_engine::backend::cuda::ipc::new_id(),
                _ => ferry_engine::backend::cuda::nccl::unique_id(),
            }
        }

        fn connect(&self, id: &[u8], rank: u32, timeout: Duration) -> Result<Box<dyn BytePipe>, String> {
            match self.kind {
                KvTransport::CudaIpc => Ok(Box::new(Ipc(IpcPipe::connect(self.ordinal, id, rank, timeout)?))),
                _ => {
                    let capacity = ferry_worker::kv::MAX_CHUNK_BYTES.max(ferry_worker::kv::frame::HEADER_BYTES);
                    Ok(Box::new(Nccl(NcclPipe::connect(self.ordinal, id, rank, timeout, capacity)?)))
                }
            }
        }

        fn device(&self) -> u32 {
            self.ordinal as u32
        }

        fn device_uuid(&self) -> Option<[u8; 16]> {
            self.uuid
        }
    }

    struct Nccl(NcclPipe);

    impl BytePipe for Nccl {
        fn send(&mut self, data: &[u8], deadline: Instant) -> Result<(), String> {
            self.0.send(data, deadline)
        }

        fn recv(&mut self, buf: &mut [u8], deadline: Instant) -> Result<(), String> {
            self.0.recv(buf, deadline)
        }

        /// A layer on this GPU goes device to device, with no host copy on either side. (Host
        /// bytes, which a GPU worker does not produce, go through a device buffer of their own,
        /// so each frame is still one message of its full size.)
        fn send_buffer(&mut self, buf: &KvBuffer, range: Range<usize>, deadline: Instant) -> Result<(), String> {
            match buf {
                KvBuffer::Cuda(d) => self.0.send_device(d, range, deadline),
                KvBuffer::Host(_) => {
                    let mut staged = KvBuffer::Cuda(self.0.alloc(range.len())?);
                    staged.write(0, &buf.to_host(range).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
                    self.send_buffer(&staged, 0..staged.len(), deadline)
                }
            }
        }

        fn recv_buffer(&mut self, buf: &mut KvBuffer, range: Range<usize>, deadline: Instant) -> Result<(), String> {
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

    struct Ipc(IpcPipe);

    impl BytePipe for Ipc {
        fn send(&mut self, data: &[u8], deadline: Instant) -> Result<(), String> {
            self.0.send(data, deadline)
        }

        fn recv(&mut self, buf: &mut [u8], deadline: Instant) -> Result<(), String> {
            self.0.recv(buf, deadline)
        }

        /// Copied on this GPU straight into the receiver's exported buffer.
        fn send_buffer(&mut self, buf: &KvBuffer, range: Range<usize>, deadline: Instant) -> Result<(), String> {
            match buf {
                KvBuffer::Cuda(d) => self.0.send_device(d, range, deadline),
                KvBuffer::Host(v) => self.0.send_host_as_buffer(&v[range], deadline),
            }
        }

        fn recv_buffer(&mut self, buf: &mut KvBuffer, range: Range<usize>, deadline: Instant) -> Result<(), String> {
            match buf {
                KvBuffer::Cuda(d) => self.0.recv_device(d, range, deadline),
                KvBuffer::Host(v) => self.0.recv_host_buffer(&mut v[range], deadline),
            }
        }

        /// An exported buffer on this GPU: the sender writes into it in place.
        fn alloc_buffer(&mut self, len: usize) -> Result<KvBuffer, String> {
            self.0.alloc(len).map(KvBuffer::Cuda)
        }
    }
}

/// `data` in a device buffer on `device` (as a GPU prefill worker exports a layer).
#[cfg(feature = "cuda")]
pub fn device_buffer(device: ferry_engine::Device, data: &[u8]) -> anyhow::Result<ferry_engine::KvBuffer> {
    let ferry_engine::Device::Cuda(n) = device else { anyhow::bail!("device buffers need --device cuda") };
    let mut b = ferry_engine::KvBuffer::Cuda(ferry_engine::backend::cuda::DeviceBytes::alloc(n, data.len())?);
    b.write(0, data)?;
    Ok(b)
}

/// Bytes per second `device` copies device to device (a `len`-byte buffer, each byte once).
#[cfg(feature = "cuda")]
pub fn device_copy_rate(device: ferry_engine::Device, len: usize) -> anyhow::Result<f64> {
    let ferry_engine::Device::Cuda(n) = device else { anyhow::bail!("a device copy needs --device cuda") };
    Ok(ferry_engine::backend::cuda::DeviceBytes::copy_rate(n, len)?)
}

#[cfg(not(feature = "cuda"))]
pub fn device_buffer(_device: ferry_engine::Device, _data: &[u8]) -> anyhow::Result<ferry_engine::KvBuffer> {
    anyhow::bail!("this build has no CUDA (rebuild with `--features cuda`)")
}

#[cfg(not(feature = "cuda"))]
pub fn device_copy_rate(_device: ferry_engine::Device, _len: usize) -> anyhow::Result<f64> {
    anyhow::bail!("this build has no CUDA (rebuild with `--features cuda`)")
}
