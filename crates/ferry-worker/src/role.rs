//! What a worker is: its [`Role`] in the cluster, and the KV transport it prefers
//! ([`TransportChoice`]).

use ferry_proto::v1::WorkerRole;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
    /// Prefill and decode in one loop (the colocated baseline).
    Colocated,
}

impl Role {
    pub fn wire(self) -> WorkerRole {
        match self {
            Role::Prefill => WorkerRole::Prefill,
            Role::Decode => WorkerRole::Decode,
            Role::Colocated => WorkerRole::Colocated,
        }
    }

    /// The role's name in logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Colocated => "colocated",
        }
    }
}

/// Which transport a prefill worker uses for KV when the router leaves the choice to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportChoice {
    /// The framed TCP data path (the default: several times gRPC's throughput).
    Tcp,
    /// KV chunks as gRPC messages.
    Grpc,
    /// Device to device over NCCL (GPU workers; falls back to TCP or gRPC when a pair cannot
    /// set it up).
    Nccl,
    /// Device to device through CUDA IPC (GPU workers on one node; falls back likewise).
    CudaIpc,
}

impl TransportChoice {
    /// The wire transport of this choice.
    pub fn kind(self) -> ferry_proto::v1::KvTransport {
        use ferry_proto::v1::KvTransport as K;
        match self {
            TransportChoice::Tcp => K::Tcp,
            TransportChoice::Grpc => K::Grpc,
            TransportChoice::Nccl => K::Nccl,
            TransportChoice::CudaIpc => K::CudaIpc,
        }
    }

    /// The device pipe this choice asks for, if any.
    pub fn pipe(self) -> Option<ferry_proto::v1::KvTransport> {
        match self {
            TransportChoice::Nccl | TransportChoice::CudaIpc => Some(self.kind()),
            TransportChoice::Tcp | TransportChoice::Grpc => None,
        }
    }
}
