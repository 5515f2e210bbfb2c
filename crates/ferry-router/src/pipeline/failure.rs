//! A failed worker call: what to do about it (`ferry_core::failure::classify`, from the status
//! alone) and its effects on the registry.

use ferry_core::WorkerRole;
use ferry_core::failure::{self, Blame, Decision, Phase, WorkerFault};
use tonic::Status;

use crate::RouterError;
use crate::pipeline::call::{Interrupt, reachable};
use crate::pipeline::request::{CutShort, Failed, Job, Progress};
use crate::state::Shared;
use crate::workers::registry::Worker;

/// The decision for a failed call to `callee` (with `peer` the other worker of the request, for
/// a prefill), and its effects on the registry: a draining worker is marked so, a suspect one
/// that no longer accepts connections is marked dead, and the blamed one is avoided.
///
/// `phase` is the attempt's own: admission and prefill pass [`Phase::BeforeFirstToken`] (nothing
/// of this attempt reached the client; [`crate::pipeline::drive`] counts a migration by what the request had
/// streamed before), the relay passes the request's.
pub async fn failed(shared: &Shared, prog: &mut Progress<'_>, job: &Job, phase: Phase, role: WorkerRole, callee: &Worker, peer: Option<&Worker>, s: Status) -> Failed {
    let fault = s.metadata().get(failure::FAULT_KEY).and_then(|v| v.to_str().ok()).and_then(WorkerFault::parse);
    let decision = failure::classify(s.code() as i32, fault, phase);
    let reg = &shared.registry;
    if fault == Some(WorkerFault::Draining) {
        reg.mark_draining(&callee.id);
    }
    let (blame, suspect) = match decision {
        Decision::Retry { blame, suspect } | Decision::Migrate { blame, suspect } => (blame, suspect),
        Decision::Wait | Decision::Final => (Blame::Callee, false),
    };
    let (blamed, blamed_role) = match (blame, peer) {
        (Blame::Peer, Some(p)) => (p, WorkerRole::Decode),
        _ => (callee, role),
    };
    if suspect && !reachable(&blamed.grpc_addr).await {
        reg.mark_dead(&blamed.id, s.message());
    }
    if matches!(decision, Decision::Retry { .. } | Decision::Migrate { .. }) && !prog.avoid.contains(&blamed.id) {
        prog.avoid.push(blamed.id.clone());
    }
    let error = match decision {
        Decision::Final => RouterError::WorkerFailed {
            role,
            worker: callee.id.clone(),
            request_id: job.request_id.clone(),
            code: s.code(),
            message: s.message().into(),
        },
        _ => RouterError::WorkerUnavailable {
            role: blamed_role,
            worker: blamed.id.clone(),
            request_id: job.request_id.clone(),
            message: format!("{:?}: {}", s.code(), s.message()),
        },
    };
    Failed { error, decision }
}

/// Maps a watched call's interruption to the attempt's halt.
pub async fn interrupted(shared: &Shared, prog: &mut Progress<'_>, job: &Job, phase: Phase, role: WorkerRole, callee: &Worker, peer: Option<&Worker>, i: Interrupt) -> CutShort {
    match i {
        Interrupt::ClientGone => CutShort::ClientGone,
        Interrupt::Failed(s) => CutShort::Failed(failed(shared, prog, job, phase, role, callee, peer, s).await),
    }
}
