//! TLS for every gRPC hop, in one place: the PEM files a process is given ([`TlsConfig`]), checked
//! and loaded into the server side ([`ServerTls`], with mutual TLS when a client CA is given) and
//! the client side ([`ClientTls`]) of tonic's rustls (ring provider), and [`endpoint`], which every
//! client uses to dial: `https://` with TLS, `http://` without.
//!
//! The router and the workers are both servers and clients. One process has one identity: its
//! `--tls-cert`/`--tls-key` serve, and (unless `--tls-client-cert`/`--tls-client-key` say
//! otherwise) are also presented when it dials a server that requires client certificates.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rustls_pki_types::pem::{self, PemObject};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

#[cfg(feature = "dev-certs")]
pub mod dev;

/// Longest TLS handshake either side waits for (a peer that connects and says nothing, or speaks
/// plaintext to a TLS port, fails instead of hanging).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// What went wrong with a TLS setting or file. Every variant names the option and the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{flag} {}: cannot read it: {source}", path.display())]
    Read {
        flag: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{flag} {}: no PEM certificate in it (expected a `-----BEGIN CERTIFICATE-----` block){}", path.display(), if *has_key { "; it holds a private key: is it the key file?" } else { "" })]
    NoCertificate {
        flag: &'static str,
        path: PathBuf,
        has_key: bool,
    },
    #[error("{flag} {}: no PEM private key in it (expected `-----BEGIN PRIVATE KEY-----`, `RSA PRIVATE KEY` or `EC PRIVATE KEY`)", path.display())]
    NoKey { flag: &'static str, path: PathBuf },
    #[error("{flag} {}: corrupt PEM: {message}", path.display())]
    BadPem {
        flag: &'static str,
        path: PathBuf,
        message: String,
    },
    /// rustls refused the files together (e.g. a key that does not match the certificate).
    #[error("{what}: rejected by TLS: {message}")]
    Rejected { what: String, message: String },
    /// An option that needs another one.
    #[error("{0}")]
    Incomplete(&'static str),
    #[error("address {addr:?} is invalid: {message}")]
    BadAddress { addr: String, message: String },
    #[error("address {addr:?} says https:// but no TLS is configured (give --tls-ca)")]
    HttpsWithoutTls { addr: String },
    /// Making throwaway certificates (`ferry up --tls`).
    #[error("generating certificates: {message}")]
    Generate { message: String },
    #[error("writing {}: {source}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The TLS options of a process, as PEM file paths (all optional; nothing set: plaintext).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsConfig {
    /// Serve TLS with this certificate (chain, leaf first)…
    pub cert: Option<PathBuf>,
    /// …and this private key.
    pub key: Option<PathBuf>,
    /// Serving: require client certificates signed by this CA (mutual TLS).
    pub client_ca: Option<PathBuf>,
    /// Dialing: TLS to every server, verified against this CA.
    pub ca: Option<PathBuf>,
    /// Dialing: present this certificate (default: `cert`, when set)…
    pub client_cert: Option<PathBuf>,
    /// …with this key (default: `key`).
    pub client_key: Option<PathBuf>,
    /// Dialing: the name server certificates must carry (default: the host dialed, DNS name or
    /// IP address). For servers dialed by addresses their certificates cannot list (pod IPs).
    pub server_name: Option<String>,
}

/// Both sides, loaded.
#[derive(Clone, Debug, Default)]
pub struct Tls {
    /// TLS on the listeners (None: plaintext).
    pub server: Option<ServerTls>,
    /// TLS when dialing (None: plaintext).
    pub client: Option<ClientTls>,
}

impl Tls {
    /// Whether anything is encrypted: then nothing may travel in cleartext either.
    pub fn enabled(&self) -> bool {
        self.server.is_some() || self.client.is_some()
    }
}

/// The server side: an identity, and the CA client certificates must chain to (mutual TLS).
#[derive(Clone, Debug)]
pub struct ServerTls {
    identity: Identity,
    client_ca: Option<Certificate>,
}

impl ServerTls {
    /// tonic's server configuration (handshakes time out after [`HANDSHAKE_TIMEOUT`]).
    pub fn config(&self) -> ServerTlsConfig {
        let c = ServerTlsConfig::new().identity(self.identity.clone()).timeout(HANDSHAKE_TIMEOUT);
        match &self.client_ca {
            Some(ca) => c.client_ca_root(ca.clone()).client_auth_optional(false),
            None => c,
        }
    }

    /// Whether clients must present a certificate signed by the client CA.
    pub fn requires_client_cert(&self) -> bool {
        self.client_ca.is_some()
    }
}

/// The client side: the CA servers are verified against, optionally a client identity and the
/// name expected in server certificates.
#[derive(Clone, Debug)]
pub struct ClientTls {
    ca: Certificate,
    identity: Option<Identity>,
    server_name: Option<String>,
}

impl ClientTls {
    /// tonic's client configuration (handshakes time out after [`HANDSHAKE_TIMEOUT`]).
    pub fn config(&self) -> ClientTlsConfig {
        let mut c = ClientTlsConfig::new().ca_certificate(self.ca.clone()).timeout(HANDSHAKE_TIMEOUT);
        if let Some(id) = &self.identity {
            c = c.identity(id.clone());
        }
        if let Some(name) = &self.server_name {
            c = c.domain_name(name.clone());
        }
        c
    }

    /// Whether a client certificate is presented.
    pub fn has_identity(&self) -> bool {
        self.identity.is_some()
    }
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { flag, path: path.to_owned(), source })
}

/// Reads a PEM file of certificates (at least one; any corrupt block is an error).
pub fn load_certs(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    let bytes = read(flag, path)?;
    let bad = |e: pem::Error| TlsError::BadPem { flag, path: path.to_owned(), message: e.to_string() };
    let certs = CertificateDer::pem_slice_iter(&bytes).collect::<Result<Vec<_>, _>>().map_err(bad)?;
    if certs.is_empty() {
        let has_key = PrivateKeyDer::from_pem_slice(&bytes).is_ok();
        return Err(TlsError::NoCertificate { flag, path: path.to_owned(), has_key });
    }
    Ok(bytes)
}

/// Reads a PEM file holding a private key (PKCS#8, PKCS#1 or SEC1).
pub fn load_key(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    let bytes = read(flag, path)?;
    match PrivateKeyDer::from_pem_slice(&bytes) {
        Ok(_) => Ok(bytes),
        Err(pem::Error::NoItemsFound) => Err(TlsError::NoKey { flag, path: path.to_owned() }),
        Err(e) => Err(TlsError::BadPem { flag, path: path.to_owned(), message: e.to_string() }),
    }
}

fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// An error and its sources on one line (tonic's transport errors say only "transport error" at
/// the top; the TLS reason is in the chain).
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    chain(e)
}

impl TlsConfig {
    /// Whether any option is set.
    pub fn is_empty(&self) -> bool {
        *self == TlsConfig::default()
    }

    /// Reads and checks every file; errors name the option and the file.
    pub fn load(&self) -> Result<Tls, TlsError> {
        Ok(Tls { server: self.server()?, client: self.client()? })
    }

    /// The server side (None without `cert`).
    pub fn server(&self) -> Result<Option<ServerTls>, TlsError> {
        let (cert, key) = match (&self.cert, &self.key) {
            (Some(c), Some(k)) => (c, k),
            (None, None) if self.client_ca.is_some() => return Err(TlsError::Incomplete("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is on top of TLS)")),
            (None, None) => return Ok(None),
            (Some(_), None) => return Err(TlsError::Incomplete("--tls-cert needs --tls-key")),
            (None, Some(_)) => return Err(TlsError::Incomplete("--tls-key needs --tls-cert")),
        };
        let identity = Identity::from_pem(load_certs("--tls-cert", cert)?, load_key("--tls-key", key)?);
        let client_ca = match &self.client_ca {
            Some(p) => Some(Certificate::from_pem(load_certs("--tls-client-ca", p)?)),
            None => None,
        };
        let tls = ServerTls { identity, client_ca };
        // rustls checks the set now (a key that does not match its certificate), not at serve time.
        tonic::transport::Server::builder().tls_config(tls.config()).map_err(|e| TlsError::Rejected {
            what: format!("--tls-cert {} with --tls-key {}", cert.display(), key.display()),
            message: chain(&e),
        })?;
        Ok(Some(tls))
    }

    /// The client side (None without `ca`).
    pub fn client(&self) -> Result<Option<ClientTls>, TlsError> {
        let Some(ca) = &self.ca else {
            return match (&self.client_cert, &self.client_key, &self.server_name) {
                (None, None, None) => Ok(None),
                (_, _, Some(_)) => Err(TlsError::Incomplete("--tls-server-name needs --tls-ca")),
                _ => Err(TlsError::Incomplete("--tls-client-cert and --tls-client-key need --tls-ca (the CA that signed the server's certificate)")),
            };
        };
        let (cert, cert_flag, key, key_flag) = match (&self.client_cert, &self.client_key) {
            (Some(c), Some(k)) => (Some(c), "--tls-client-cert", Some(k), "--tls-client-key"),
            (Some(_), None) => return Err(TlsError::Incomplete("--tls-client-cert needs --tls-client-key")),
            (None, Some(_)) => return Err(TlsError::Incomplete("--tls-client-key needs --tls-client-cert")),
            // The serving identity doubles as the client identity.
            (None, None) => (self.cert.as_ref(), "--tls-cert", self.key.as_ref(), "--tls-key"),
        };
        let identity = match (cert, key) {
            (Some(c), Some(k)) => Some(Identity::from_pem(load_certs(cert_flag, c)?, load_key(key_flag, k)?)),
            _ => None,
        };
        let tls = ClientTls { ca: Certificate::from_pem(load_certs("--tls-ca", ca)?), identity, server_name: self.server_name.clone() };
        Endpoint::from_static("https://ferry.invalid").tls_config(tls.config()).map_err(|e| TlsError::Rejected {
            what: match (cert, key) {
                (Some(c), Some(k)) => format!("{cert_flag} {} with {key_flag} {} and --tls-ca {}", c.display(), k.display(), ca.display()),
                _ => format!("--tls-ca {}", ca.display()),
            },
            message: chain(&e),
        })?;
        Ok(Some(tls))
    }
}

/// The URI to dial `addr` (`host:port`, or with a scheme) at: `https://` with TLS, `http://`
/// without. An explicit `http://` is upgraded when TLS is on; an explicit `https://` without TLS
/// is an error (it could not be verified).
pub fn uri(addr: &str, tls: Option<&ClientTls>) -> Result<String, TlsError> {
    let (scheme, rest) = match addr.split_once("://") {
        Some((s, rest)) => (Some(s.to_ascii_lowercase()), rest),
        None => (None, addr),
    };
    match (scheme.as_deref(), tls) {
        (Some("https"), None) => Err(TlsError::HttpsWithoutTls { addr: addr.into() }),
        (Some("http" | "https") | None, Some(_)) => Ok(format!("https://{rest}")),
        (Some("http") | None, None) => Ok(format!("http://{rest}")),
        (Some(other), _) => Err(TlsError::BadAddress { addr: addr.into(), message: format!("unknown scheme {other:?} (use host:port)") }),
    }
}

/// An endpoint for `addr` that speaks TLS when `tls` is given (see [`uri`]). Callers add their
/// own timeouts and windows.
pub fn endpoint(addr: &str, tls: Option<&ClientTls>) -> Result<Endpoint, TlsError> {
    let bad = |e: tonic::transport::Error| TlsError::BadAddress { addr: addr.into(), message: chain(&e) };
    let ep = Endpoint::from_shared(uri(addr, tls)?).map_err(bad)?;
    match tls {
        Some(t) => ep.tls_config(t.config()).map_err(bad),
        None => Ok(ep),
    }
}

/// A hint for a failed connection: what to check about TLS on this side.
pub fn connect_hint(tls: Option<&ClientTls>) -> &'static str {
    match tls {
        None => "if the server uses TLS, pass --tls-ca (and --tls-client-cert/--tls-client-key if it requires client certificates)",
        Some(t) if !t.has_identity() => "TLS handshake: check that --tls-ca signed the server's certificate and that it names the host dialed (or --tls-server-name); a server that requires client certificates needs --tls-client-cert/--tls-client-key",
        Some(_) => "TLS handshake: check that --tls-ca signed the server's certificate and that it names the host dialed (or --tls-server-name), and that the server's --tls-client-ca signed the client certificate",
    }
}

#[cfg(test)]
mod tests;
