//! Throwaway certificates (feature `dev-certs`, with rcgen on ring): a CA, a node certificate for
//! loopback that serves and dials (router and workers), and a client certificate (the CLI, tests).
//! `ferry up --tls` makes one set per run; the tests make several (one per CA they need).

use std::io::Write;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

use super::{TlsConfig, TlsError};

/// The names a loopback cluster is dialed by.
pub const LOOPBACK_NAMES: &[&str] = &["localhost", "127.0.0.1", "::1"];

/// A CA and the certificates it signed, as PEM files in `dir` (keys 0600, the folder 0700). The
/// folder is removed on drop when this value created it.
#[derive(Debug)]
pub struct DevPki {
    pub dir: PathBuf,
    /// The CA certificate (`--tls-ca`, `--tls-client-ca`).
    pub ca: PathBuf,
    /// The node certificate and key: server and client auth, for `names`.
    pub cert: PathBuf,
    pub key: PathBuf,
    /// A client-only certificate and key.
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    owned: bool,
}

impl Drop for DevPki {
    fn drop(&mut self) {
        if self.owned {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn generate_error(e: rcgen::Error) -> TlsError {
    TlsError::Generate { message: e.to_string() }
}

fn write(path: &Path, text: &str, secret: bool) -> Result<(), TlsError> {
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut o, if secret { 0o600 } else { 0o644 });
    #[cfg(not(unix))]
    let _ = secret;
    o.open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .map_err(|source| TlsError::Write { path: path.to_owned(), source })
}

fn leaf(cn: &str, names: &[&str], purposes: &[ExtendedKeyUsagePurpose]) -> Result<CertificateParams, TlsError> {
    let mut p = CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>()).map_err(generate_error)?;
    p.distinguished_name.push(DnType::CommonName, cn);
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = purposes.to_vec();
    p.use_authority_key_identifier_extension = true;
    Ok(p)
}

impl DevPki {
    /// A fresh set in a new private folder under the system's temp dir, removed on drop.
    pub fn temp(names: &[&str]) -> Result<DevPki, TlsError> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
        let dir = std::env::temp_dir().join(format!("ferry-tls-{}-{}-{nanos}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed)));
        let mut b = std::fs::DirBuilder::new();
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
        b.create(&dir).map_err(|source| TlsError::Write { path: dir.clone(), source })?;
        let mut pki = DevPki::generate_in(&dir, names);
        match &mut pki {
            Ok(p) => p.owned = true,
            Err(_) => {
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
        pki
    }

    /// A fresh CA, node and client certificate written into the existing folder `dir`; the node
    /// certificate carries `names` (DNS names or IP addresses) as subject alternative names.
    pub fn generate_in(dir: &Path, names: &[&str]) -> Result<DevPki, TlsError> {
        let ca_key = KeyPair::generate().map_err(generate_error)?;
        let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(generate_error)?;
        // A name of its own: two throwaway CAs must not look like the same issuer.
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        ca.distinguished_name.push(DnType::CommonName, format!("ferry throwaway CA {:x}-{nanos:x}", std::process::id()));
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let ca_cert = ca.self_signed(&ca_key).map_err(generate_error)?;
        let issuer = Issuer::new(ca, ca_key);

        let node_key = KeyPair::generate().map_err(generate_error)?;
        let node = leaf("ferry node", names, &[ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth])?
            .signed_by(&node_key, &issuer)
            .map_err(generate_error)?;
        let client_key = KeyPair::generate().map_err(generate_error)?;
        let client = leaf("ferry client", &["ferry-client"], &[ExtendedKeyUsagePurpose::ClientAuth])?
            .signed_by(&client_key, &issuer)
            .map_err(generate_error)?;

        let pki = DevPki {
            dir: dir.to_owned(),
            ca: dir.join("ca.pem"),
            cert: dir.join("node.pem"),
            key: dir.join("node.key"),
            client_cert: dir.join("client.pem"),
            client_key: dir.join("client.key"),
            owned: false,
        };
        write(&pki.ca, &ca_cert.pem(), false)?;
        write(&pki.cert, &node.pem(), false)?;
        write(&pki.key, &node_key.serialize_pem(), true)?;
        write(&pki.client_cert, &client.pem(), false)?;
        write(&pki.client_key, &client_key.serialize_pem(), true)?;
        Ok(pki)
    }

    /// A router's or worker's options: serve with the node certificate, require client
    /// certificates from this CA, dial with TLS verified by it (presenting the node certificate).
    pub fn node(&self) -> TlsConfig {
        TlsConfig {
            cert: Some(self.cert.clone()),
            key: Some(self.key.clone()),
            client_ca: Some(self.ca.clone()),
            ca: Some(self.ca.clone()),
            ..TlsConfig::default()
        }
    }

    /// A client's options: verify servers by this CA, present the client certificate.
    pub fn client(&self) -> TlsConfig {
        TlsConfig {
            ca: Some(self.ca.clone()),
            client_cert: Some(self.client_cert.clone()),
            client_key: Some(self.client_key.clone()),
            ..TlsConfig::default()
        }
    }
}
