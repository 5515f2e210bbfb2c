//! `--max-connections`, `--header-timeout-ms` and `--body-timeout-ms`: the connection limits of `ferry router`'s and
//! the workers' servers ([`ferry_proto::conn`]).

use std::time::Duration;

use ferry_proto::conn::ConnLimits;

#[derive(clap::Args, Clone, Debug)]
pub struct ConnArgs {
    /// Most connections each API server (gRPC, and the router's HTTP API) holds open at once; one
    /// more is closed as soon as it is accepted, logged, and counted in
    /// `ferry_router_connections_refused_total` (`ferry_worker_…` on a worker). Default: 4096 on the router, 1024 on a worker.
    /// `/metrics` servers hold at most 64.
    #[arg(long, value_name = "N")]
    pub max_connections: Option<usize>,
    /// A new connection that has not sent a complete request head (HTTP/1) or its HTTP/2
    /// preface (gRPC) within this is closed; on HTTP/1 it is also how long a kept-alive
    /// connection may wait for its next request.
    #[arg(long, value_name = "MS", default_value_t = 10_000)]
    pub header_timeout_ms: u64,
    /// An HTTP request's body must arrive whole within this once its head is in, else the request
    /// is refused (408) and its connection closed.
    #[arg(long, value_name = "MS", default_value_t = 30_000)]
    pub body_timeout_ms: u64,
}

impl ConnArgs {
    /// The limits these flags give, over `default` (the server's own cap).
    pub fn limits(&self, default: ConnLimits) -> anyhow::Result<ConnLimits> {
        let max_connections = self.max_connections.unwrap_or(default.max_connections);
        anyhow::ensure!(max_connections > 0, "--max-connections must be at least 1");
        anyhow::ensure!(self.header_timeout_ms > 0, "--header-timeout-ms must be at least 1");
        anyhow::ensure!(self.body_timeout_ms > 0, "--body-timeout-ms must be at least 1");
        Ok(ConnLimits {
            max_connections,
            header_timeout: Duration::from_millis(self.header_timeout_ms),
            body_timeout: Duration::from_millis(self.body_timeout_ms),
        })
    }
}
