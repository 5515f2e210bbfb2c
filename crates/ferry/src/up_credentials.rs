//! The credentials `ferry up` gives the cluster it starts, so that its default is closed: the
//! cluster secret (given through FERRY_CLUSTER_SECRET or `--cluster-secret-file`, or made here)
//! and the admin token (`--admin-token`, or made here). The admin token is written to a file in a
//! private folder (0700, removed on exit) whose path `ferry up` prints for `ferry pool
//! --admin-token-file`; the secret reaches the router and the workers only through their
//! environment, never a command line.

use std::path::{Path, PathBuf};

use anyhow::Context;
use ferry_proto::ClusterSecret;

pub struct UpCredentials {
    pub secret: ClusterSecret,
    pub admin_token: String,
    dir: PathBuf,
}

/// 256 random bits as 64 hex characters (the thread-local CSPRNG, seeded by the OS).
fn random_hex() -> String {
    rand::random::<[u8; 32]>().iter().map(|b| format!("{b:02x}")).collect()
}

impl UpCredentials {
    /// `secret_file`: `--cluster-secret-file`; FERRY_CLUSTER_SECRET is read here too.
    pub fn new(secret_file: Option<&Path>, admin_token: Option<&str>) -> anyhow::Result<UpCredentials> {
        let given = match (secret_file, std::env::var(ferry_proto::cluster::ENV).ok().filter(|s| !s.trim().is_empty())) {
            (Some(_), Some(_)) => anyhow::bail!("both --cluster-secret-file and {} are set: use one", ferry_proto::cluster::ENV),
            (Some(p), None) => Some(std::fs::read_to_string(p).with_context(|| format!("reading the cluster secret from {}", p.display()))?),
            (None, env) => env,
        };
        let secret = ClusterSecret::new(&given.unwrap_or_else(random_hex)).context("the cluster secret")?;
        let admin_token = admin_token.map(str::trim).filter(|t| !t.is_empty()).map_or_else(random_hex, str::to_owned);
        let dir = std::env::temp_dir().join(format!("ferry-up-{}-{}", std::process::id(), &random_hex()[..8]));
        let mut b = std::fs::DirBuilder::new();
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
        b.create(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let creds = UpCredentials { secret, admin_token, dir };
        let mut f = std::fs::OpenOptions::new();
        f.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut f, 0o600);
        let path = creds.admin_token_file();
        std::io::Write::write_all(&mut f.open(&path).with_context(|| format!("creating {}", path.display()))?, creds.admin_token.as_bytes())?;
        Ok(creds)
    }

    /// The file holding the admin token (for `ferry pool --admin-token-file`).
    pub fn admin_token_file(&self) -> PathBuf {
        self.dir.join("admin-token")
    }

    /// What the router's and the workers' environment carry.
    pub fn secret_env(&self) -> (&'static str, String) {
        (ferry_proto::cluster::ENV, self.secret.reveal().unwrap_or_default().to_owned())
    }
}

impl Drop for UpCredentials {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
