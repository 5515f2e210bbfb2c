//! Which transport carries one transfer: a pure decision over what the router asked for and what
//! this worker has, tested from a table below. The service turns the [`Choice`] into transports.

use crate::role::TransportChoice;
use ferry_proto::v1::KvTransport as Kind;

/// What decides a transfer's transport.
#[derive(Clone, Copy, Debug)]
pub struct Situation {
    /// The router's choice for the pair (the target's `transport`; `Unspecified`: none).
    pub requested: Kind,
    /// This worker's own preference, for requests whose target names no transport.
    pub prefer: TransportChoice,
    /// The plaintext TCP data path may be used (not with TLS).
    pub allow_tcp: bool,
    /// The decode worker offers a TCP data address.
    pub data_addr: bool,
    /// The device pipes this worker has (their transport), if any.
    pub pipe: Option<Kind>,
}

/// A host transport.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Host {
    Tcp,
    Grpc,
}

/// The transport for one transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// A host transport.
    Host(Host),
    /// This worker's device pipe, falling back to `then` when the pair cannot set it up.
    Pipe { then: Host },
    /// A device pipe was asked for that this worker does not have: `host` instead.
    MissingPipe { wanted: Kind, host: Host },
}

/// The router's choice for the pair, else this worker's preference. A device pipe falls back to
/// the host path; the host path is TCP where it can be used (no TLS, and the decode worker has a
/// data address), else gRPC.
pub fn choose(s: &Situation) -> Choice {
    let wanted = match s.requested {
        Kind::Unspecified => s.prefer.kind(),
        k => k,
    };
    let host = if s.allow_tcp && s.data_addr { Host::Tcp } else { Host::Grpc };
    match wanted {
        Kind::Grpc => Choice::Host(Host::Grpc),
        Kind::Nccl | Kind::CudaIpc => match s.pipe {
            Some(pipe) if pipe == wanted => Choice::Pipe { then: host },
            _ => Choice::MissingPipe { wanted, host },
        },
        Kind::Tcp | Kind::Unspecified => Choice::Host(host),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use TransportChoice as P;

    #[test]
    fn the_choice_follows_the_request_then_the_preference_with_fallbacks() {
        let s = |requested, prefer, allow_tcp, data_addr, pipe| Situation { requested, prefer, allow_tcp, data_addr, pipe };
        let cases = [
            (s(Kind::Unspecified, P::Tcp, true, true, None), Choice::Host(Host::Tcp)),
            (s(Kind::Unspecified, P::Grpc, true, true, None), Choice::Host(Host::Grpc)),
            // No data address, or TLS: TCP falls back to gRPC.
            (s(Kind::Tcp, P::Tcp, true, false, None), Choice::Host(Host::Grpc)),
            (s(Kind::Tcp, P::Tcp, false, true, None), Choice::Host(Host::Grpc)),
            // The router's choice wins over the preference.
            (s(Kind::Grpc, P::Tcp, true, true, None), Choice::Host(Host::Grpc)),
            (s(Kind::Tcp, P::Grpc, true, true, None), Choice::Host(Host::Tcp)),
            (s(Kind::Nccl, P::Tcp, true, true, Some(Kind::Nccl)), Choice::Pipe { then: Host::Tcp }),
            (s(Kind::Unspecified, P::Nccl, false, true, Some(Kind::Nccl)), Choice::Pipe { then: Host::Grpc }),
            (s(Kind::CudaIpc, P::Tcp, true, true, Some(Kind::CudaIpc)), Choice::Pipe { then: Host::Tcp }),
            // A pipe of another kind, or none: the host path.
            (s(Kind::CudaIpc, P::Tcp, true, true, Some(Kind::Nccl)), Choice::MissingPipe { wanted: Kind::CudaIpc, host: Host::Tcp }),
            (s(Kind::Nccl, P::Tcp, true, false, None), Choice::MissingPipe { wanted: Kind::Nccl, host: Host::Grpc }),
        ];
        for (situation, want) in cases {
            assert_eq!(choose(&situation), want, "{situation:?}");
        }
    }
}
