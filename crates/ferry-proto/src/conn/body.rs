//! [`TimedBody`]: an HTTP request body that must arrive whole within a deadline, so a client
//! cannot hold a request (and its connection) open by trickling the body a byte at a time after
//! a prompt head. Past the deadline the body fails with [`BodyTimedOut`]; the handler reading it
//! answers with an error and hyper closes the connection (the rest of the body is never read).
//! nginx's `client_body_timeout` is the same idea, between reads; this bounds the whole body,
//! which the slowest trickle cannot stretch.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::body::{Body, Frame, Incoming, SizeHint};
use tokio::time::Sleep;

use super::Server;

/// A request body with a deadline for all of it.
pub struct TimedBody {
    inner: Incoming,
    deadline: Pin<Box<Sleep>>,
    limit: Duration,
    server: Server,
}

impl TimedBody {
    /// `inner`, which must end within `limit` from now.
    pub fn new(inner: Incoming, limit: Duration, server: Server) -> TimedBody {
        TimedBody { inner, deadline: Box::pin(tokio::time::sleep(limit)), limit, server }
    }
}

/// The body did not arrive whole in time.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {} ms", .limit_ms)]
pub struct BodyTimedOut {
    pub limit_ms: u128,
}

impl Body for TimedBody {
    type Data = bytes::Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(r) => Poll::Ready(r.map(|f| f.map_err(Into::into))),
            Poll::Pending => {
                if this.deadline.as_mut().poll(cx).is_ready() {
                    metrics::counter!(this.server.names().body_timed_out, "server" => this.server.label()).increment(1);
                    tracing::debug!(server = this.server.label(), "a request body did not arrive within {:?}", this.limit);
                    return Poll::Ready(Some(Err(Box::new(BodyTimedOut { limit_ms: this.limit.as_millis() }))));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
