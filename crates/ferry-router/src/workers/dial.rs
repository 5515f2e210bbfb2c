//! How the router dials workers (and `ferry up`'s scaler): one endpoint setting for every
//! channel (timeouts, HTTP/2 windows and keepalive, TLS) and channels that carry the cluster
//! secret on every call.

use std::time::Duration;

use ferry_proto::tls::ClientTls;
use tonic::transport::{Channel, Endpoint};

use crate::RouterError;

/// HTTP/2 flow-control windows for worker channels and the server (KV chunks are large).
pub const WINDOW_BYTES: u32 = 32 << 20;
/// HTTP/2 keepalive on every channel the router dials: a ping this often, and the connection
/// is dropped when one goes unanswered this long.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(4);
/// Largest gRPC message the router sends or accepts.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// A channel to a worker whose every call carries the cluster secret.
pub type WorkerChannel = tonic::service::interceptor::InterceptedService<Channel, ferry_proto::Bearer>;

/// How the router dials workers (and `ferry up`'s scaler).
#[derive(Clone, Debug)]
pub struct DialOptions {
    pub connect_timeout: Duration,
    /// TLS to every worker (None: plaintext).
    pub tls: Option<ClientTls>,
    /// The cluster secret every call to a worker (and to `ferry up`'s scaler) carries.
    pub cluster: ferry_proto::ClusterSecret,
}

/// A lazily connecting endpoint to a worker with the router's timeouts, windows and TLS.
pub fn endpoint(addr: &str, dial: &DialOptions) -> Result<Endpoint, RouterError> {
    let ep = ferry_proto::tls::endpoint(addr, dial.tls.as_ref()).map_err(|e| {
        RouterError::BadAddress {
            addr: addr.into(),
            message: e.to_string(),
        }
    })?;
    Ok(ep
        .connect_timeout(dial.connect_timeout)
        .initial_stream_window_size(WINDOW_BYTES)
        .initial_connection_window_size(WINDOW_BYTES)
        .tcp_nodelay(true)
        // A frozen worker (SIGSTOP, a hung host) keeps its TCP connections open; HTTP/2 pings
        // find it within interval + timeout and fail every call on the connection.
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true))
}

/// A lazily connected channel to the worker at `addr`, carrying the cluster secret.
pub fn channel(addr: &str, dial: &DialOptions) -> Result<WorkerChannel, RouterError> {
    Ok(WorkerChannel::new(endpoint(addr, dial)?.connect_lazy(), dial.cluster.bearer()))
}
