//! [`serve_http`]: HTTP/1 for a tower service (an axum `Router`) on an [`Acceptor`], with hyper's
//! `header_read_timeout`, a deadline for each request's body ([`TimedBody`]) and graceful
//! shutdown. It replaces `axum::serve`, which sets no timer, so its connections could hold a
//! half-sent request head or body forever.

use std::future::Future;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::{Body, Incoming};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;

use super::{Acceptor, Server, TimedBody};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Serves `svc` on `acceptor`'s connections until `shutdown`, then stops accepting and waits for
/// the open connections to finish their requests (idle ones close at once).
///
/// Each connection must send a complete request head within the acceptor's `header_timeout`
/// (counted from the connection's start, or from the previous response on a kept-alive one);
/// else it is closed and counted in `ferry_<component>_connections_timed_out_total{server}`. Its body must
/// then arrive whole within `body_timeout`, else reading it fails ([`super::BodyTimedOut`]).
pub async fn serve_http<S, B>(mut acceptor: Acceptor, svc: S, shutdown: impl Future<Output = ()>)
where
    S: tower_service::Service<hyper::Request<TimedBody>, Response = hyper::Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1.timer(TokioTimer::new()).header_read_timeout(acceptor.limits().header_timeout);
    let graceful = GracefulShutdown::new();
    let server = acceptor.server();
    let svc = Timed { inner: svc, limit: acceptor.limits().body_timeout, server };
    tokio::pin!(shutdown);
    loop {
        let conn = tokio::select! {
            c = acceptor.accept() => c,
            () = &mut shutdown => break,
        };
        let served = graceful.watch(http1.serve_connection(TokioIo::new(conn), TowerToHyperService::new(svc.clone())));
        tokio::spawn(async move {
            if let Err(e) = served.await {
                if e.is_timeout() {
                    metrics::counter!(server.names().timed_out, "server" => server.label()).increment(1);
                }
                tracing::debug!(server = server.label(), "HTTP connection ended: {e}");
            }
        });
    }
    drop(acceptor);
    graceful.shutdown().await;
}

/// `inner` with each request's body under its deadline.
#[derive(Clone)]
struct Timed<S> {
    inner: S,
    limit: Duration,
    server: Server,
}

impl<S> tower_service::Service<hyper::Request<Incoming>> for Timed<S>
where
    S: tower_service::Service<hyper::Request<TimedBody>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: hyper::Request<Incoming>) -> Self::Future {
        let (limit, server) = (self.limit, self.server);
        self.inner.call(req.map(|b| TimedBody::new(b, limit, server)))
    }
}
