//! Which server a connection came to ([`Server`]), and the metric families that count them, one
//! set per component ([`Component::families`]): a router's `/metrics` says
//! `ferry_router_connections_*`, a worker's `ferry_worker_connections_*`, each labelled with the
//! server.

use crate::metrics::Family;

/// The process a server runs in, which names its metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Component {
    Router,
    Worker,
}

/// Every server Ferry runs that takes connections through an [`super::Acceptor`] (or, for the KV
/// data port, counts its refusals the same way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Server {
    RouterGrpc,
    RouterHttp,
    RouterMetrics,
    WorkerGrpc,
    WorkerMetrics,
    WorkerKvData,
}

impl Server {
    /// The `server` label.
    pub const fn label(self) -> &'static str {
        match self {
            Server::RouterGrpc => "router_grpc",
            Server::RouterHttp => "router_http",
            Server::RouterMetrics => "router_metrics",
            Server::WorkerGrpc => "worker_grpc",
            Server::WorkerMetrics => "worker_metrics",
            Server::WorkerKvData => "worker_kv_data",
        }
    }

    pub const fn component(self) -> Component {
        match self {
            Server::RouterGrpc | Server::RouterHttp | Server::RouterMetrics => Component::Router,
            Server::WorkerGrpc | Server::WorkerMetrics | Server::WorkerKvData => Component::Worker,
        }
    }

    /// The names its connections are counted under.
    pub const fn names(self) -> &'static ConnNames {
        self.component().names()
    }
}

/// The connection families of one component.
#[derive(Debug)]
pub struct ConnNames {
    pub open: &'static str,
    pub refused: &'static str,
    pub evicted: &'static str,
    pub timed_out: &'static str,
    pub body_timed_out: &'static str,
}

const ROUTER: ConnNames = ConnNames {
    open: "ferry_router_connections_open",
    refused: "ferry_router_connections_refused_total",
    evicted: "ferry_router_connections_evicted_total",
    timed_out: "ferry_router_connections_timed_out_total",
    body_timed_out: "ferry_router_connections_body_timed_out_total",
};

const WORKER: ConnNames = ConnNames {
    open: "ferry_worker_connections_open",
    refused: "ferry_worker_connections_refused_total",
    evicted: "ferry_worker_connections_evicted_total",
    timed_out: "ferry_worker_connections_timed_out_total",
    body_timed_out: "ferry_worker_connections_body_timed_out_total",
};

const fn families(n: &'static ConnNames) -> [Family; 5] {
    [
        Family::gauge(n.open, "Connections held open now, by server."),
        Family::counter(
            n.refused,
            "New connections closed at once because the server was at its connection cap and every held connection had opened (raise --max-connections if this rises under normal load).",
        ),
        Family::counter(
            n.evicted,
            "Connections still opening (no complete request head, HTTP/2 preface or TLS handshake) closed to make room at the connection cap.",
        ),
        Family::counter(n.timed_out, "Connections closed for sending no request head (HTTP) or preface / TLS handshake (gRPC) within --header-timeout-ms."),
        Family::counter(n.body_timed_out, "HTTP requests refused with 408 because their body did not arrive within --body-timeout-ms."),
    ]
}

const ROUTER_FAMILIES: [Family; 5] = families(&ROUTER);
const WORKER_FAMILIES: [Family; 5] = families(&WORKER);

impl Component {
    pub const fn names(self) -> &'static ConnNames {
        match self {
            Component::Router => &ROUTER,
            Component::Worker => &WORKER,
        }
    }

    /// The connection families, for the component's catalogue.
    pub const fn families(self) -> &'static [Family] {
        match self {
            Component::Router => &ROUTER_FAMILIES,
            Component::Worker => &WORKER_FAMILIES,
        }
    }
}
