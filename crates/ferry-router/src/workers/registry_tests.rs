use super::*;
use crate::workers::load::{InflightGuard, Ready};

fn reg_req(role: v1::WorkerRole, addr: &str, fp: &str) -> v1::RegisterRequest {
    v1::RegisterRequest {
        role: role as i32,
        grpc_addr: addr.into(),
        fingerprint: fp.into(),
        max_context: 2048,
        ..Default::default()
    }
}

fn registry() -> Registry {
    Registry::new(
        Duration::from_secs(3),
        Duration::from_secs(1),
        DialOptions {
            connect_timeout: Duration::from_secs(1),
            tls: None,
            cluster: Default::default(),
        },
    )
}

// A restarted router hands ids out afresh: the worker that re-registers first may get the
// id another worker still heart-beats with. That heartbeat must not renew the other's entry
// (it would never register again, and the router would list one worker for two), and its
// deregistration must not remove it.
#[tokio::test]
async fn an_id_handed_out_again_answers_only_its_own_worker() {
    let r = registry();
    let id = r
        .register(&reg_req(v1::WorkerRole::Prefill, "127.0.0.1:2", "fp"))
        .unwrap()
        .worker_id;
    assert_eq!(id, "prefill-1");
    let t0 = Instant::now();
    let hb = |addr: &str| {
        r.heartbeat(
            &v1::HeartbeatRequest {
                worker_id: id.clone(),
                grpc_addr: addr.into(),
                ..Default::default()
            },
            t0,
        )
    };
    // The worker that held prefill-1 before the restart, at another address.
    assert!(matches!(hb("127.0.0.1:1"), Err(RouterError::UnknownWorker(_))));
    assert!(r.get("prefill-1").is_some_and(|w| w.grpc_addr == "127.0.0.1:2"));
    assert_eq!(hb("127.0.0.1:2").unwrap().state, WorkerState::Ready);
    // An old client that sends no address is still answered by id.
    assert_eq!(hb("").unwrap().state, WorkerState::Ready);
    r.deregister("prefill-1", "127.0.0.1:1");
    assert!(r.get("prefill-1").is_some());
    r.deregister("prefill-1", "127.0.0.1:2");
    assert!(r.get("prefill-1").is_none());
}

#[tokio::test]
async fn ids_fingerprint_heartbeat_and_lease() {
    let r = registry();
    let a = r
        .register(&reg_req(v1::WorkerRole::Prefill, "127.0.0.1:1", "fp"))
        .unwrap();
    let b = r
        .register(&reg_req(v1::WorkerRole::Decode, "127.0.0.1:2", "fp"))
        .unwrap();
    let c = r
        .register(&reg_req(v1::WorkerRole::Prefill, "127.0.0.1:3", "fp"))
        .unwrap();
    assert_eq!(
        (
            a.worker_id.as_str(),
            b.worker_id.as_str(),
            c.worker_id.as_str()
        ),
        ("prefill-1", "decode-1", "prefill-2")
    );
    assert_eq!((a.lease_ms, a.heartbeat_ms), (3000, 1000));
    let err = r
        .register(&reg_req(v1::WorkerRole::Decode, "127.0.0.1:4", "other"))
        .unwrap_err();
    assert!(
        err.to_string().contains("other") && err.to_string().contains("fp"),
        "{err}"
    );
    assert_eq!(
        tonic::Status::from(err).code(),
        tonic::Code::FailedPrecondition
    );

    let t0 = Instant::now();
    let hb = |id: &str, at| {
        r.heartbeat(
            &v1::HeartbeatRequest {
                worker_id: id.into(),
                ..Default::default()
            },
            at,
        )
    };
    assert_eq!(
        hb("prefill-1", t0 + Duration::from_secs(2)).unwrap().state,
        WorkerState::Ready
    );
    assert!(matches!(hb("nope", t0), Err(RouterError::UnknownWorker(_))));
    // At t0+4.5 s: prefill-1 renewed at t0+2 s (alive), the other two expired.
    let mut dead = r.sweep(t0 + Duration::from_millis(4500));
    dead.sort();
    assert_eq!(dead, vec!["decode-1", "prefill-2"]);
    assert_eq!(r.ready(), Ready { prefill: 1, ..Ready::default() });
    // A dead worker's heartbeat is refused (NOT_FOUND) and the entry forgotten.
    assert!(matches!(
        hb("decode-1", t0),
        Err(RouterError::UnknownWorker(_))
    ));
    assert!(r.get("decode-1").is_none());
}

#[tokio::test]
async fn drain_undrain_remove_and_guards() {
    let r = Arc::new(registry());
    r.register(&reg_req(v1::WorkerRole::Prefill, "127.0.0.1:1", "fp"))
        .unwrap();
    assert_eq!(
        r.drain("prefill-1").unwrap().state,
        v1::WorkerState::Draining as i32
    );
    assert_eq!(r.ready(), Ready::default());
    assert_eq!(
        r.undrain("prefill-1").unwrap().state,
        v1::WorkerState::Ready as i32
    );
    {
        let _g = InflightGuard::new(&r, "prefill-1", 100);
        let _h = InflightGuard::new(&r, "prefill-1", 20);
        let c = &r.prefill_candidates()[0];
        assert_eq!((c.inflight, c.outstanding_tokens), (2, 120));
    }
    let c = &r.prefill_candidates()[0];
    assert_eq!((c.inflight, c.outstanding_tokens), (0, 0));
    r.mark_dead("prefill-1", "test");
    assert_eq!(r.ready(), Ready::default());
    r.remove("prefill-1").unwrap();
    assert!(matches!(
        r.remove("prefill-1"),
        Err(RouterError::UnknownWorker(_))
    ));
}

// A worker's heartbeat reports the prompts it holds, this router's among them, and lags by up to
// a heartbeat: a prompt the router saw finish leaves the report at once, and the router's own
// outstanding prompts are not counted a second time.
#[tokio::test]
async fn a_finished_prompt_leaves_the_worker_s_last_queue_report() {
    let r = Arc::new(registry());
    let id = r.register(&reg_req(v1::WorkerRole::Prefill, "127.0.0.1:1", "fp")).unwrap().worker_id;
    let queued = |r: &Registry| r.prefill_candidates()[0].queued_tokens();
    let first = InflightGuard::new(&r, &id, 300);
    let second = InflightGuard::new(&r, &id, 200);
    assert_eq!(queued(&r), 500);
    // The heartbeat taken while both were queued there, with another router's 100.
    let load = v1::WorkerLoad { queued_prefill_tokens: 600, ..Default::default() };
    r.heartbeat(&v1::HeartbeatRequest { worker_id: id.clone(), load: Some(load), ..Default::default() }, Instant::now()).unwrap();
    assert_eq!(queued(&r), 600, "the report holds the router's 500: not 1,100");
    drop(first);
    assert_eq!(queued(&r), 300, "the finished 300 leave the report before the next heartbeat");
    drop(second);
    assert_eq!(queued(&r), 100, "another router's prompt is still there");
}
