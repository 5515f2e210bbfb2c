//! Which KV transport each prefill→decode pair uses.
//!
//! Every worker registers the transports it can use (`RegisterRequest.kv_transports`): gRPC
//! always, the TCP data path where plaintext is allowed, NCCL on GPU workers with NCCL pipes. A
//! worker's `--kv-transport` is its ceiling (it registers nothing faster than that), and so is the
//! router's `--kv-transport`. For each request the router picks the fastest transport both workers
//! registered, under its ceiling: CUDA IPC (one node), then NCCL, then TCP, then gRPC. The prefill
//! worker falls back from a device pipe (CUDA IPC, NCCL) to the host path if the pair cannot set
//! it up (e.g. CUDA IPC between two nodes), and reports what it used.

use ferry_proto::v1::KvTransport as Kind;

/// The router's ceiling (`--kv-transport`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvPolicy {
    /// The fastest transport both workers support.
    #[default]
    Auto,
    /// At most CUDA IPC (the same as auto today).
    CudaIpc,
    /// At most NCCL (never CUDA IPC).
    Nccl,
    /// At most the TCP data path (never NCCL).
    Tcp,
    /// gRPC only.
    Grpc,
}

impl KvPolicy {
    fn ceiling(self) -> Kind {
        match self {
            KvPolicy::Auto | KvPolicy::CudaIpc => Kind::CudaIpc,
            KvPolicy::Nccl => Kind::Nccl,
            KvPolicy::Tcp => Kind::Tcp,
            KvPolicy::Grpc => Kind::Grpc,
        }
    }
}

/// Fastest first.
const ORDER: [Kind; 4] = [Kind::CudaIpc, Kind::Nccl, Kind::Tcp, Kind::Grpc];

fn rank(k: Kind) -> usize {
    ORDER.iter().position(|&o| o == k).unwrap_or(ORDER.len())
}

/// What a worker registered, with the defaults for workers that predate the field (empty list):
/// gRPC, plus TCP for a prefill worker or a decode worker with a data address.
pub fn registered(kv_transports: &[i32], prefill: bool, data_addr: &str) -> Vec<Kind> {
    let mut v: Vec<Kind> = kv_transports.iter().filter_map(|&k| Kind::try_from(k).ok()).filter(|&k| k != Kind::Unspecified).collect();
    if kv_transports.is_empty() {
        v.push(Kind::Grpc);
        if prefill || !data_addr.is_empty() {
            v.push(Kind::Tcp);
        }
    }
    v
}

/// The transport for one pair: the fastest both registered, under the policy's ceiling; gRPC
/// when they share nothing else (every worker serves it).
pub fn choose(policy: KvPolicy, prefill: &[Kind], decode: &[Kind]) -> Kind {
    let top = rank(policy.ceiling());
    ORDER.into_iter().skip(top).find(|k| prefill.contains(k) && decode.contains(k)).unwrap_or(Kind::Grpc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Kind::{CudaIpc, Grpc, Nccl, Tcp};

    #[test]
    fn the_fastest_common_transport_under_the_ceiling() {
        let all = [Grpc, Tcp, Nccl];
        let cases: &[(KvPolicy, &[Kind], &[Kind], Kind)] = &[
            (KvPolicy::Auto, &all, &all, Nccl),
            (KvPolicy::Nccl, &all, &all, Nccl),
            (KvPolicy::Tcp, &all, &all, Tcp),
            (KvPolicy::Grpc, &all, &all, Grpc),
            // NCCL on one side only: the host path.
            (KvPolicy::Auto, &all, &[Grpc, Tcp], Tcp),
            (KvPolicy::Auto, &[Grpc, Tcp], &all, Tcp),
            // No data listener on the decode side (or TLS): gRPC, even with NCCL asked for.
            (KvPolicy::Nccl, &[Grpc, Tcp], &[Grpc], Grpc),
            // A prefill worker limited to gRPC (`--kv-transport grpc`).
            (KvPolicy::Auto, &[Grpc], &all, Grpc),
            // NCCL without TCP on either side (TLS on GPU workers).
            (KvPolicy::Auto, &[Grpc, Nccl], &[Grpc, Nccl], Nccl),
            (KvPolicy::Tcp, &[Grpc, Nccl], &[Grpc, Nccl], Grpc),
            // Nothing registered in common: gRPC, which every worker serves.
            (KvPolicy::Auto, &[], &[], Grpc),
            // CUDA IPC above NCCL when both registered it; the NCCL ceiling keeps it off.
            (KvPolicy::Auto, &[Grpc, Tcp, CudaIpc], &[Grpc, Tcp, CudaIpc], CudaIpc),
            (KvPolicy::CudaIpc, &[Grpc, Tcp, CudaIpc], &[Grpc, Tcp, CudaIpc], CudaIpc),
            (KvPolicy::Nccl, &[Grpc, Tcp, CudaIpc], &[Grpc, Tcp, CudaIpc], Tcp),
            // One side with NCCL pipes, the other with CUDA IPC pipes: the host path.
            (KvPolicy::Auto, &[Grpc, Tcp, CudaIpc], &[Grpc, Tcp, Nccl], Tcp),
        ];
        for (policy, p, d, want) in cases {
            assert_eq!(choose(*policy, p, d), *want, "{policy:?} prefill {p:?} decode {d:?}");
        }
    }

    #[test]
    fn workers_that_registered_no_list_get_the_old_defaults() {
        assert_eq!(registered(&[], true, ""), vec![Grpc, Tcp]);
        assert_eq!(registered(&[], false, ""), vec![Grpc]);
        assert_eq!(registered(&[], false, "10.0.0.1:7000"), vec![Grpc, Tcp]);
        assert_eq!(registered(&[Grpc as i32, Nccl as i32, 99], false, ""), vec![Grpc, Nccl]);
    }
}
