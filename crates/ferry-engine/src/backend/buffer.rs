//! [`KvBuffer`]: KV bytes where a backend keeps them — host memory for the CPU backend, device
//! memory for CUDA — so a device-to-device transport (NCCL) moves a layer from the prefill GPU's
//! gather buffer to the decode GPU's receive buffer without staging it through either host.
//! Host transports take the bytes with [`KvBuffer::to_host`].

use crate::error::{EngineError, Result};
use std::ops::Range;

/// KV bytes in a backend's memory: one layer's section (K then V, token-contiguous) from
/// [`Backend::kv_export_layer_buffer`](super::Backend::kv_export_layer_buffer), or a whole
/// payload body received from a peer.
pub enum KvBuffer {
    Host(Vec<u8>),
    #[cfg(feature = "cuda")]
    Cuda(super::cuda::DeviceBytes),
}

impl std::fmt::Debug for KvBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KvBuffer({} bytes on {})", self.len(), self.location())
    }
}

impl KvBuffer {
    pub fn len(&self) -> usize {
        match self {
            KvBuffer::Host(v) => v.len(),
            #[cfg(feature = "cuda")]
            KvBuffer::Cuda(d) => d.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `host` or `cuda:N`.
    pub fn location(&self) -> String {
        match self {
            KvBuffer::Host(_) => "host".into(),
            #[cfg(feature = "cuda")]
            KvBuffer::Cuda(d) => format!("cuda:{}", d.ordinal()),
        }
    }

    fn check(&self, range: &Range<usize>) -> Result<()> {
        if range.start > range.end || range.end > self.len() {
            return Err(EngineError::Config(format!("bytes {}..{} of a {}-byte KV buffer", range.start, range.end, self.len())));
        }
        Ok(())
    }

    /// [`ferry_core::kv_payload::word_checksum`] of bytes `range`, computed where they are.
    pub fn checksum(&self, range: Range<usize>) -> Result<u32> {
        self.check(&range)?;
        match self {
            KvBuffer::Host(v) => Ok(ferry_core::kv_payload::word_checksum(&v[range])),
            #[cfg(feature = "cuda")]
            KvBuffer::Cuda(d) => d.checksum(range),
        }
    }

    /// A copy of bytes `range` in host memory.
    pub fn to_host(&self, range: Range<usize>) -> Result<Vec<u8>> {
        self.check(&range)?;
        match self {
            KvBuffer::Host(v) => Ok(v[range].to_vec()),
            #[cfg(feature = "cuda")]
            KvBuffer::Cuda(d) => d.to_host(range),
        }
    }

    /// The bytes, when they are in host memory.
    pub fn as_host(&self) -> Option<&[u8]> {
        match self {
            KvBuffer::Host(v) => Some(v),
            #[cfg(feature = "cuda")]
            KvBuffer::Cuda(_) => None,
        }
    }

    /// Overwrite bytes `offset..offset + data.len()` with `data` from the host.
    pub fn write(&mut self, offset: usize, data: &[u8]) -> Result<()> {
        let range = offset..offset.checked_add(data.len()).ok_or_else(|| EngineError::Config("KV buffer offset overflows".into()))?;
        self.check(&range)?;
        match self {
            KvBuffer::Host(v) => {
                v[range].copy_from_slice(data);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            KvBuffer::Cuda(d) => d.write(offset, data),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_buffers_check_their_ranges() {
        let mut b = KvBuffer::Host((0..64u8).collect());
        assert_eq!(b.checksum(4..20).unwrap(), ferry_core::kv_payload::word_checksum(&(4..20u8).collect::<Vec<_>>()));
        assert_eq!(b.to_host(60..64).unwrap(), vec![60, 61, 62, 63]);
        b.write(62, &[9, 9]).unwrap();
        assert_eq!(b.to_host(60..64).unwrap(), vec![60, 61, 9, 9]);
        assert!(b.write(63, &[1, 2]).unwrap_err().to_string().contains("64-byte"));
        assert!(b.checksum(10..65).is_err());
        assert!(b.to_host(usize::MAX..usize::MAX).is_err());
        assert!(b.write(usize::MAX, &[1]).is_err());
    }
}
