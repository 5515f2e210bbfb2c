//! The TLS options, shared by every command that serves or dials gRPC: `ferry router` and the
//! workers take both groups, `ferry generate --router` and `ferry pool` the dialing one. They
//! become one [`ferry_proto::tls::TlsConfig`], checked and loaded there.

use std::path::PathBuf;

use ferry_proto::tls::TlsConfig;

/// Serving gRPC over TLS.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ServeTlsArgs {
    /// Serve gRPC over TLS with this certificate (PEM, leaf first, then intermediates). Also the
    /// client certificate this process presents when it dials (unless --tls-client-cert).
    #[arg(long, value_name = "PEM", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Mutual TLS: require every client to present a certificate signed by this CA (PEM).
    /// Clients without one, or with one from another CA, fail the TLS handshake.
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    pub tls_client_ca: Option<PathBuf>,
}

/// Dialing gRPC servers over TLS.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct DialTlsArgs {
    /// Dial over TLS (https), verifying servers against this CA (PEM). Without it, plaintext.
    #[arg(long, value_name = "PEM")]
    pub tls_ca: Option<PathBuf>,
    /// The client certificate to present to servers that require one (mutual TLS; PEM).
    #[arg(long, value_name = "PEM", requires_all = ["tls_ca", "tls_client_key"])]
    pub tls_client_cert: Option<PathBuf>,
    /// The private key of --tls-client-cert (PEM).
    #[arg(long, value_name = "PEM", requires = "tls_client_cert")]
    pub tls_client_key: Option<PathBuf>,
    /// The name server certificates must carry, instead of the host dialed (for servers dialed
    /// by IP addresses their certificates do not list, e.g. pod IPs: give every certificate one
    /// shared DNS name and pass it here).
    #[arg(long, value_name = "NAME", requires = "tls_ca")]
    pub tls_server_name: Option<String>,
}

impl DialTlsArgs {
    /// The options of a process that only dials.
    pub fn config(&self) -> TlsConfig {
        tls_config(&ServeTlsArgs::default(), self)
    }

    /// Loaded: None for plaintext.
    pub fn client(&self) -> anyhow::Result<Option<ferry_proto::tls::ClientTls>> {
        Ok(self.config().client()?)
    }
}

/// The options of a process that serves and dials.
pub fn tls_config(serve: &ServeTlsArgs, dial: &DialTlsArgs) -> TlsConfig {
    TlsConfig {
        cert: serve.tls_cert.clone(),
        key: serve.tls_key.clone(),
        client_ca: serve.tls_client_ca.clone(),
        ca: dial.tls_ca.clone(),
        client_cert: dial.tls_client_cert.clone(),
        client_key: dial.tls_client_key.clone(),
        server_name: dial.tls_server_name.clone(),
    }
}
