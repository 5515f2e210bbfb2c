//! Choosing the backend at run time: [`Device`] (`--device cpu|cuda|cuda:N`) and
//! [`DeviceBackend`], one [`Backend`] over every backend this build has, so the engine, the
//! workers and the CLI are written once and the device is a value, not a type.
//!
//! Dispatch is one `match` per operation (a forward step makes a few hundred calls; each does far
//! more work than the branch). Values of one backend are never handed to another: the engine
//! creates every tensor, weight, cache and batch through the same backend, so a mismatch is a bug
//! in this crate, reported by [`mixed`].

use super::cpu::{CpuBackend, CpuBatch, CpuKv, CpuTensor, CpuWeight};
#[cfg(feature = "cuda")]
use super::cuda::{CudaBackend, CudaBatch, CudaKv, CudaTensor, CudaWeight};
use super::{Backend, BatchPlan, KvBuffer, RopeTable};
use crate::error::{EngineError, Result};
use crate::weights::HostWeight;
use ferry_core::KvLayout;

/// A compute device: the host CPU, or a CUDA GPU by ordinal.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Device {
    #[default]
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = EngineError;
    /// `cpu`, `cuda` (= `cuda:0`) or `cuda:N`.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| EngineError::BadDevice(s.to_string())),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// Every backend this build has, chosen by [`Device`].
pub enum DeviceBackend {
    Cpu(CpuBackend),
    #[cfg(feature = "cuda")]
    Cuda(CudaBackend),
}

/// A value of one backend was passed to another: an internal bug, never caused by input.
#[cold]
fn mixed() -> ! {
    panic!("ferry-engine: a tensor, weight, cache or batch of one backend was passed to another")
}

/// Unwraps one backend's value from a device enum; which backend is inferred from the inner
/// backend's method signature, so [`dispatch`]'s body is the same text for every backend.
trait Pick<T> {
    fn pick(&self) -> &T;
    fn pick_mut(&mut self) -> &mut T;
}

/// An enum over one associated type of each backend, with `From` and [`Pick`] per variant.
macro_rules! device_enum {
    ($name:ident, $cpu:ty, $cuda:ident) => {
        pub enum $name {
            Cpu($cpu),
            #[cfg(feature = "cuda")]
            Cuda($cuda),
        }
        impl From<$cpu> for $name {
            fn from(v: $cpu) -> Self {
                Self::Cpu(v)
            }
        }
        #[allow(unreachable_patterns)]
        impl Pick<$cpu> for $name {
            fn pick(&self) -> &$cpu {
                match self {
                    Self::Cpu(v) => v,
                    _ => mixed(),
                }
            }
            fn pick_mut(&mut self) -> &mut $cpu {
                match self {
                    Self::Cpu(v) => v,
                    _ => mixed(),
                }
            }
        }
        #[cfg(feature = "cuda")]
        impl From<$cuda> for $name {
            fn from(v: $cuda) -> Self {
                Self::Cuda(v)
            }
        }
        #[cfg(feature = "cuda")]
        impl Pick<$cuda> for $name {
            fn pick(&self) -> &$cuda {
                match self {
                    Self::Cuda(v) => v,
                    _ => mixed(),
                }
            }
            fn pick_mut(&mut self) -> &mut $cuda {
                match self {
                    Self::Cuda(v) => v,
                    _ => mixed(),
                }
            }
        }
    };
}

device_enum!(DeviceTensor, CpuTensor, CudaTensor);
device_enum!(DeviceWeight, CpuWeight, CudaWeight);
device_enum!(DeviceKv, CpuKv, CudaKv);
device_enum!(DeviceBatch, CpuBatch, CudaBatch);

/// `$body` once per backend, with `$b` bound to the inner backend.
macro_rules! dispatch {
    ($self:expr, |$b:ident| $body:expr) => {
        match $self {
            DeviceBackend::Cpu($b) => $body,
            #[cfg(feature = "cuda")]
            DeviceBackend::Cuda($b) => $body,
        }
    };
}

impl DeviceBackend {
    pub fn device(&self) -> Device {
        match self {
            DeviceBackend::Cpu(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            DeviceBackend::Cuda(b) => Device::Cuda(b.ordinal()),
        }
    }
}

impl Backend for DeviceBackend {
    type Tensor = DeviceTensor;
    type Weight = DeviceWeight;
    type Kv = DeviceKv;
    type Batch = DeviceBatch;

    fn describe(&self) -> String {
        dispatch!(self, |b| b.describe())
    }
    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> Result<R> {
        dispatch!(self, |b| b.run(f))
    }
    fn upload(&self, w: &HostWeight) -> Result<DeviceWeight> {
        dispatch!(self, |b| b.upload(w).map(Into::into))
    }
    fn tensor(&self, rows: usize, cols: usize) -> DeviceTensor {
        dispatch!(self, |b| b.tensor(rows, cols).into())
    }
    fn rows(&self, t: &DeviceTensor) -> usize {
        dispatch!(self, |b| b.rows(t.pick()))
    }
    fn prepare(&self, plan: &BatchPlan, rope: &RopeTable) -> DeviceBatch {
        dispatch!(self, |b| b.prepare(plan, rope).into())
    }
    fn embed(&self, table: &DeviceWeight, ids: &[u32], out: &mut DeviceTensor) {
        dispatch!(self, |b| b.embed(table.pick(), ids, out.pick_mut()))
    }
    fn rms_norm(&self, x: &DeviceTensor, w: &DeviceWeight, eps: f32, out: &mut DeviceTensor) {
        dispatch!(self, |b| b.rms_norm(x.pick(), w.pick(), eps, out.pick_mut()))
    }
    fn head_rms_norm(&self, x: &mut DeviceTensor, w: &DeviceWeight, head_dim: usize, eps: f32) {
        dispatch!(self, |b| b.head_rms_norm(x.pick_mut(), w.pick(), head_dim, eps))
    }
    fn add(&self, x: &mut DeviceTensor, y: &DeviceTensor) {
        dispatch!(self, |b| b.add(x.pick_mut(), y.pick()))
    }
    fn add_rms_norm(&self, x: &mut DeviceTensor, y: &DeviceTensor, w: &DeviceWeight, eps: f32, out: &mut DeviceTensor) {
        dispatch!(self, |b| Backend::add_rms_norm(b, x.pick_mut(), y.pick(), w.pick(), eps, out.pick_mut()))
    }
    fn matmul(&self, x: &DeviceTensor, ws: &[(&DeviceWeight, Option<&DeviceWeight>)], outs: &mut [&mut DeviceTensor]) {
        dispatch!(self, |b| {
            let ws: Vec<_> = ws.iter().map(|(w, bias)| (w.pick(), bias.map(|x| x.pick()))).collect();
            let mut outs: Vec<_> = outs.iter_mut().map(|o| o.pick_mut()).collect();
            b.matmul(x.pick(), &ws, &mut outs)
        })
    }
    fn rope(&self, x: &mut DeviceTensor, batch: &DeviceBatch, head_dim: usize) {
        dispatch!(self, |b| b.rope(x.pick_mut(), batch.pick(), head_dim))
    }
    fn rope_qk(&self, q: &mut DeviceTensor, k: &mut DeviceTensor, batch: &DeviceBatch, head_dim: usize) {
        dispatch!(self, |b| b.rope_qk(q.pick_mut(), k.pick_mut(), batch.pick(), head_dim))
    }
    fn silu_mul(&self, gate: &mut DeviceTensor, up: &DeviceTensor) {
        dispatch!(self, |b| b.silu_mul(gate.pick_mut(), up.pick()))
    }
    fn kv_write(&self, kv: &mut DeviceKv, layer: usize, k: &DeviceTensor, v: &DeviceTensor, batch: &DeviceBatch) {
        dispatch!(self, |b| b.kv_write(kv.pick_mut(), layer, k.pick(), v.pick(), batch.pick()))
    }
    fn attention(&self, q: &DeviceTensor, kv: &DeviceKv, layer: usize, batch: &DeviceBatch, out: &mut DeviceTensor) {
        dispatch!(self, |b| b.attention(q.pick(), kv.pick(), layer, batch.pick(), out.pick_mut()))
    }
    fn gather_rows(&self, x: &DeviceTensor, rows: &[usize]) -> DeviceTensor {
        dispatch!(self, |b| b.gather_rows(x.pick(), rows).into())
    }
    fn to_host(&self, x: &DeviceTensor) -> Vec<f32> {
        dispatch!(self, |b| b.to_host(x.pick()))
    }
    fn kv_budget_bytes(&self, fraction: f32) -> Result<Option<usize>> {
        dispatch!(self, |b| b.kv_budget_bytes(fraction))
    }
    fn kv_alloc(&self, layout: &KvLayout, num_blocks: usize) -> Result<DeviceKv> {
        dispatch!(self, |b| b.kv_alloc(layout, num_blocks).map(Into::into))
    }
    fn kv_export_layer(&self, kv: &DeviceKv, layer: usize, blocks: &[u32], tokens: usize, out: &mut Vec<u8>) -> Result<()> {
        dispatch!(self, |b| b.kv_export_layer(kv.pick(), layer, blocks, tokens, out))
    }
    fn kv_import_layer(&self, kv: &mut DeviceKv, layer: usize, blocks: &[u32], tokens: usize, section: &[u8]) -> Result<()> {
        dispatch!(self, |b| b.kv_import_layer(kv.pick_mut(), layer, blocks, tokens, section))
    }
    fn kv_export_layer_buffer(&self, kv: &DeviceKv, layer: usize, blocks: &[u32], tokens: usize) -> Result<KvBuffer> {
        dispatch!(self, |b| b.kv_export_layer_buffer(kv.pick(), layer, blocks, tokens))
    }
    fn kv_import_layer_buffer(&self, kv: &mut DeviceKv, layer: usize, blocks: &[u32], tokens: usize, buf: &KvBuffer, section: std::ops::Range<usize>) -> Result<()> {
        dispatch!(self, |b| b.kv_import_layer_buffer(kv.pick_mut(), layer, blocks, tokens, buf, section))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices() {
        for (s, d) in [("cpu", Device::Cpu), ("cuda", Device::Cuda(0)), ("CUDA:3", Device::Cuda(3)), (" cuda:0 ", Device::Cuda(0))] {
            assert_eq!(s.parse::<Device>().unwrap(), d, "{s}");
        }
        for bad in ["", "tpu", "cuda:", "cuda:x", "cuda:-1", "cpu:0"] {
            let e = bad.parse::<Device>().unwrap_err();
            assert!(matches!(e, EngineError::BadDevice(_)), "{bad}: {e}");
        }
        assert_eq!(Device::Cuda(2).to_string(), "cuda:2");
    }
}
