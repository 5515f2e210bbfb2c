//! Conversions between the wire enums and `ferry-core`'s (the router's own; `ferry-proto` stays
//! generated code plus sampling conversions); public for `ferry-testkit`'s mock workers.

use ferry_core::{WorkerRole, WorkerState};
use ferry_proto::v1;

pub fn role_from_wire(role: i32) -> Option<WorkerRole> {
    match v1::WorkerRole::try_from(role).ok()? {
        v1::WorkerRole::Prefill => Some(WorkerRole::Prefill),
        v1::WorkerRole::Decode => Some(WorkerRole::Decode),
        v1::WorkerRole::Colocated => Some(WorkerRole::Colocated),
        v1::WorkerRole::Unspecified => None,
    }
}

pub fn role_to_wire(role: WorkerRole) -> v1::WorkerRole {
    match role {
        WorkerRole::Prefill => v1::WorkerRole::Prefill,
        WorkerRole::Decode => v1::WorkerRole::Decode,
        WorkerRole::Colocated => v1::WorkerRole::Colocated,
    }
}

pub fn state_to_wire(state: WorkerState) -> v1::WorkerState {
    match state {
        WorkerState::Ready => v1::WorkerState::Ready,
        WorkerState::Draining => v1::WorkerState::Draining,
        WorkerState::Dead => v1::WorkerState::Dead,
    }
}
