//! What the router does when a call to a worker fails: one pure decision, from the status code,
//! the worker's own word on the failure (the `ferry-error` metadata), and how far the request had
//! got. Dynamo's errors say whether a request may move to another worker; here the wire says it
//! once, and the router never reads an error's text.
//!
//! A worker that answers deliberately tags its status with a [`WorkerFault`]. A status without
//! the tag came from the transport (a killed process, a reset connection, a deadline the router
//! set, a lease that ran out): the worker or its link is gone, and the request moves.

/// The metadata key a worker's status carries its [`WorkerFault`] under.
pub const FAULT_KEY: &str = "ferry-error";

/// gRPC status codes (google.rpc.Code), as this crate has no gRPC dependency.
pub mod code {
    pub const OK: i32 = 0;
    pub const CANCELLED: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const INVALID_ARGUMENT: i32 = 3;
    pub const DEADLINE_EXCEEDED: i32 = 4;
    pub const NOT_FOUND: i32 = 5;
    pub const ALREADY_EXISTS: i32 = 6;
    pub const PERMISSION_DENIED: i32 = 7;
    pub const RESOURCE_EXHAUSTED: i32 = 8;
    pub const FAILED_PRECONDITION: i32 = 9;
    pub const ABORTED: i32 = 10;
    pub const OUT_OF_RANGE: i32 = 11;
    pub const UNIMPLEMENTED: i32 = 12;
    pub const INTERNAL: i32 = 13;
    pub const UNAVAILABLE: i32 = 14;
    pub const DATA_LOSS: i32 = 15;
    pub const UNAUTHENTICATED: i32 = 16;
}

/// A worker's own account of why it refused or failed a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WorkerFault {
    /// Leaving gracefully: alive, takes nothing new. Another worker takes the request.
    Draining,
    /// No room now (KV blocks, a full queue): another worker may have some, or later this one.
    Overloaded,
    /// The peer this worker talked to for the request failed (the decode worker a prefill
    /// worker ships KV to): the peer is to blame, not this worker.
    Peer,
    /// The KV transfer for the request failed its checks or timed out (corrupt, short, late):
    /// nothing of it was used; a fresh attempt may succeed.
    Transfer,
    /// This worker's engine is broken (a panicked engine thread, a failed device) and the worker
    /// is taking itself out: everything it held moves.
    Engine,
    /// This one sequence failed on this worker (the rest of its batch goes on). Final: the same
    /// input would fail the same way elsewhere.
    Sequence,
    /// The request is wrong (no worker would accept it). Final.
    Invalid,
}

impl WorkerFault {
    pub const ALL: [WorkerFault; 7] = [
        WorkerFault::Draining,
        WorkerFault::Overloaded,
        WorkerFault::Peer,
        WorkerFault::Transfer,
        WorkerFault::Engine,
        WorkerFault::Sequence,
        WorkerFault::Invalid,
    ];

    /// The metadata value.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerFault::Draining => "draining",
            WorkerFault::Overloaded => "overloaded",
            WorkerFault::Peer => "peer",
            WorkerFault::Transfer => "transfer",
            WorkerFault::Engine => "engine",
            WorkerFault::Sequence => "sequence",
            WorkerFault::Invalid => "invalid",
        }
    }

    /// The fault a metadata value names (`None` for a value this version does not know, which
    /// is then read as no tag at all).
    pub fn parse(s: &str) -> Option<WorkerFault> {
        WorkerFault::ALL.into_iter().find(|f| f.as_str() == s)
    }
}

/// How far a request had got when the call failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Nothing has reached the client: the request can start again anywhere.
    BeforeFirstToken,
    /// Tokens have been streamed: the request continues elsewhere from where it was (migration).
    Streaming,
}

/// Which worker a failure is blamed on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Blame {
    /// The worker that was called.
    Callee,
    /// The peer the callee was talking to for this request (the decode worker of a prefill).
    Peer,
}

/// What the router does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Start the request again on other workers (nothing reached the client). `suspect`: the
    /// blamed worker may be dead (probe it or let its lease decide); otherwise it is alive.
    Retry { blame: Blame, suspect: bool },
    /// Continue the request on other workers from the tokens already streamed.
    Migrate { blame: Blame, suspect: bool },
    /// No worker has room now: wait for capacity (the router's admission queue), then retry.
    Wait,
    /// The request ends with this error.
    Final,
}

/// The decision for a failed call with status `code`, the worker's tag `fault` (if the status
/// carried one) at `phase`.
pub fn classify(code: i32, fault: Option<WorkerFault>, phase: Phase) -> Decision {
    let moved = |blame, suspect| match phase {
        Phase::BeforeFirstToken => Decision::Retry { blame, suspect },
        Phase::Streaming => Decision::Migrate { blame, suspect },
    };
    match fault {
        Some(WorkerFault::Invalid | WorkerFault::Sequence) => Decision::Final,
        Some(WorkerFault::Draining) => moved(Blame::Callee, false),
        Some(WorkerFault::Engine) => moved(Blame::Callee, true),
        Some(WorkerFault::Peer) => moved(Blame::Peer, true),
        Some(WorkerFault::Transfer) => moved(Blame::Peer, false),
        Some(WorkerFault::Overloaded) => match phase {
            Phase::BeforeFirstToken => Decision::Wait,
            Phase::Streaming => moved(Blame::Callee, false),
        },
        None => match code {
            // The transport's words: the process is gone, the connection broke, a deadline the
            // router set ran out, or the router cancelled the call because a lease expired.
            code::UNAVAILABLE | code::UNKNOWN | code::INTERNAL | code::CANCELLED | code::DEADLINE_EXCEEDED => {
                moved(Blame::Callee, true)
            }
            code::RESOURCE_EXHAUSTED => match phase {
                Phase::BeforeFirstToken => Decision::Wait,
                Phase::Streaming => moved(Blame::Callee, false),
            },
            // ABORTED from a worker of an older version: its peer failed.
            code::ABORTED => moved(Blame::Peer, true),
            // DATA_LOSS: a KV transfer failed its checks; nothing of it was used.
            code::DATA_LOSS => moved(Blame::Peer, false),
            _ => Decision::Final,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Blame::*;
    use Decision::*;
    use Phase::*;
    use WorkerFault as F;

    #[test]
    fn fault_names_round_trip_and_unknown_is_none() {
        for f in WorkerFault::ALL {
            assert_eq!(WorkerFault::parse(f.as_str()), Some(f));
        }
        assert_eq!(WorkerFault::parse("meltdown"), None);
    }

    #[test]
    fn decision_table() {
        let table: &[(i32, Option<WorkerFault>, Phase, Decision)] = &[
            // The transport: the callee is suspect, the request moves.
            (code::UNAVAILABLE, None, BeforeFirstToken, Retry { blame: Callee, suspect: true }),
            (code::UNAVAILABLE, None, Streaming, Migrate { blame: Callee, suspect: true }),
            (code::UNKNOWN, None, Streaming, Migrate { blame: Callee, suspect: true }),
            (code::INTERNAL, None, Streaming, Migrate { blame: Callee, suspect: true }),
            (code::CANCELLED, None, BeforeFirstToken, Retry { blame: Callee, suspect: true }),
            (code::DEADLINE_EXCEEDED, None, Streaming, Migrate { blame: Callee, suspect: true }),
            (code::ABORTED, None, BeforeFirstToken, Retry { blame: Peer, suspect: true }),
            (code::DATA_LOSS, None, BeforeFirstToken, Retry { blame: Peer, suspect: false }),
            // No room: wait before the first token, move after it.
            (code::RESOURCE_EXHAUSTED, None, BeforeFirstToken, Wait),
            (code::RESOURCE_EXHAUSTED, Some(F::Overloaded), BeforeFirstToken, Wait),
            (code::RESOURCE_EXHAUSTED, Some(F::Overloaded), Streaming, Migrate { blame: Callee, suspect: false }),
            // The worker's own word wins over the code.
            (code::UNAVAILABLE, Some(F::Draining), BeforeFirstToken, Retry { blame: Callee, suspect: false }),
            (code::UNAVAILABLE, Some(F::Draining), Streaming, Migrate { blame: Callee, suspect: false }),
            (code::UNAVAILABLE, Some(F::Engine), Streaming, Migrate { blame: Callee, suspect: true }),
            (code::INTERNAL, Some(F::Sequence), Streaming, Final),
            (code::INTERNAL, Some(F::Sequence), BeforeFirstToken, Final),
            (code::INVALID_ARGUMENT, Some(F::Invalid), BeforeFirstToken, Final),
            (code::ABORTED, Some(F::Peer), BeforeFirstToken, Retry { blame: Peer, suspect: true }),
            (code::DATA_LOSS, Some(F::Transfer), BeforeFirstToken, Retry { blame: Peer, suspect: false }),
            (code::DEADLINE_EXCEEDED, Some(F::Transfer), BeforeFirstToken, Retry { blame: Peer, suspect: false }),
            // Final without a tag: the request itself is at fault.
            (code::INVALID_ARGUMENT, None, BeforeFirstToken, Final),
            (code::FAILED_PRECONDITION, None, BeforeFirstToken, Final),
            (code::PERMISSION_DENIED, None, Streaming, Final),
            (code::NOT_FOUND, None, Streaming, Final),
            (code::OUT_OF_RANGE, None, BeforeFirstToken, Final),
        ];
        for &(c, f, p, want) in table {
            assert_eq!(classify(c, f, p), want, "code {c}, fault {f:?}, {p:?}");
        }
    }

    #[test]
    fn a_final_fault_is_final_whatever_the_code() {
        for c in 0..=16 {
            for p in [BeforeFirstToken, Streaming] {
                assert_eq!(classify(c, Some(F::Invalid), p), Final);
                assert_eq!(classify(c, Some(F::Sequence), p), Final);
            }
        }
    }
}
