//! The cluster secret on the command line of `ferry router`, `ferry prefill|decode|worker` (see
//! [`ferry_proto::cluster`]): from `FERRY_CLUSTER_SECRET` or a file, never from a flag's value
//! (which `ps` shows). A command without one refuses to start unless told
//! `--insecure-open-cluster`; `ferry up` makes one for the cluster it starts.

use std::path::PathBuf;

use anyhow::Context;
use ferry_proto::cluster::{ClusterSecret, ENV};

#[derive(clap::Args, Clone, Debug, Default)]
pub struct ClusterArgs {
    /// A file holding the cluster secret (at least 16 printable characters; e.g. the output of
    /// `openssl rand -hex 32`): the router, every worker and the scaler hold the same one, and
    /// every worker port serves only callers that present it. Or set FERRY_CLUSTER_SECRET.
    #[arg(long, env = "FERRY_CLUSTER_SECRET_FILE", value_name = "FILE")]
    pub cluster_secret_file: Option<PathBuf>,
    /// Run with no cluster secret: the workers' ports, their KV data port and the router's
    /// worker registration then trust any caller that can reach them. Only for a machine or
    /// network where every process is trusted; refused together with API keys or an admin token.
    #[arg(long)]
    pub insecure_open_cluster: bool,
}

impl ClusterArgs {
    /// The secret from the file or FERRY_CLUSTER_SECRET, open only when asked for.
    pub fn resolve(&self) -> anyhow::Result<ClusterSecret> {
        let from_env = std::env::var(ENV).ok().filter(|s| !s.trim().is_empty());
        let text = match (&self.cluster_secret_file, from_env) {
            (Some(_), Some(_)) => anyhow::bail!("both --cluster-secret-file and {ENV} are set: use one"),
            (Some(path), None) => {
                std::fs::read_to_string(path).with_context(|| format!("reading the cluster secret from {}", path.display()))?
            }
            (None, Some(s)) => s,
            (None, None) => {
                anyhow::ensure!(
                    self.insecure_open_cluster,
                    "no cluster secret: set {ENV} or --cluster-secret-file FILE to the same secret on the router and every worker \
                     (e.g. `openssl rand -hex 32`), or pass --insecure-open-cluster to leave every cluster port open to anyone who can reach it"
                );
                tracing::warn!("--insecure-open-cluster: the workers' ports and worker registration trust any caller");
                return Ok(ClusterSecret::open());
            }
        };
        anyhow::ensure!(!self.insecure_open_cluster, "--insecure-open-cluster and a cluster secret: drop one of them");
        ClusterSecret::new(&text).context("the cluster secret")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test touches the process environment, so the cases run in order.
    #[test]
    fn a_secret_is_required_unless_open_is_asked_for() {
        // SAFETY: no other test in this binary reads or writes FERRY_CLUSTER_SECRET.
        unsafe { std::env::remove_var(ENV) };
        let none = ClusterArgs::default();
        let e = none.resolve().unwrap_err().to_string();
        assert!(e.contains(ENV) && e.contains("--insecure-open-cluster"), "{e}");
        let open = ClusterArgs { insecure_open_cluster: true, ..Default::default() };
        assert!(!open.resolve().unwrap().is_set());

        let dir = std::env::temp_dir().join(format!("ferry-cluster-args-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("secret");
        std::fs::write(&file, "0123456789abcdef0123\n").unwrap();
        let from_file = ClusterArgs { cluster_secret_file: Some(file.clone()), ..Default::default() };
        assert_eq!(from_file.resolve().unwrap().reveal(), Some("0123456789abcdef0123"));
        let both = ClusterArgs { cluster_secret_file: Some(file.clone()), insecure_open_cluster: true };
        assert!(both.resolve().is_err());
        std::fs::write(&file, "short").unwrap();
        assert!(format!("{:#}", from_file.resolve().unwrap_err()).contains("at least 16"));
        let missing = ClusterArgs { cluster_secret_file: Some(dir.join("absent")), ..Default::default() };
        assert!(format!("{:#}", missing.resolve().unwrap_err()).contains("reading the cluster secret"));

        // SAFETY: as above.
        unsafe { std::env::set_var(ENV, "fedcba9876543210fedc") };
        assert_eq!(none.resolve().unwrap().reveal(), Some("fedcba9876543210fedc"));
        assert!(from_file.resolve().is_err(), "file and variable together");
        unsafe { std::env::remove_var(ENV) };
        std::fs::remove_dir_all(&dir).ok();
    }
}
