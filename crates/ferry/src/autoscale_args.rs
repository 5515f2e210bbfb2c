//! `--autoscale` and its knobs, shared by `ferry router` and `ferry up` (which hands them to its
//! first router).

use ferry_core::autoscale::Policy;
use std::path::PathBuf;
use std::time::Duration;

#[derive(clap::Args, Debug, Clone, Default)]
pub struct AutoscaleArgs {
    /// Scale the prefill and decode pools from the SLOs: every interval, the smallest split
    /// predicted (by `ferry plan`'s simulation over `--autoscale-profile`) to meet them at the
    /// measured load, with hysteresis and cooldowns; scale-down drains. Needs a scaler
    /// (`--kube-scale`, or `ferry up`).
    #[arg(long, requires = "autoscale_profile")]
    pub autoscale: bool,
    /// The workers' profile (`ferry profile` on their machine).
    #[arg(long, value_name = "PATH")]
    pub autoscale_profile: Option<PathBuf>,
    /// How often the autoscaler looks, ms.
    #[arg(long, default_value_t = 10_000)]
    pub autoscale_interval_ms: u64,
    /// The arrival rate is measured over this much of the recent past, ms (at least one
    /// interval): longer is steadier, shorter follows a step sooner.
    #[arg(long, default_value_t = 30_000)]
    pub autoscale_rate_window_ms: u64,
    /// Most workers in all (prefill + decode).
    #[arg(long, default_value_t = 8)]
    pub autoscale_max_workers: usize,
    #[command(flatten)]
    pub slo: crate::bench_serve::SloArgs,
    /// Plan for the measured rate times 1 + this.
    #[arg(long, default_value_t = 0.2)]
    pub autoscale_headroom: f64,
    /// No move sooner than this after the last (ms), up...
    #[arg(long, default_value_t = 20_000)]
    pub autoscale_up_cooldown_ms: u64,
    /// ...and down.
    #[arg(long, default_value_t = 60_000)]
    pub autoscale_down_cooldown_ms: u64,
    /// Intervals in a row the plan must ask for fewer workers before one goes.
    #[arg(long, default_value_t = 3)]
    pub autoscale_down_after: u32,
    /// Plan at the profile's speed, ignoring how long the workers' steps take against it (by
    /// default the plan scales each role's steps by the ratio the workers measure; see their
    /// `--profile`).
    #[arg(long)]
    pub autoscale_uncalibrated: bool,
}

impl AutoscaleArgs {
    /// The router's autoscaler, when `--autoscale` is on.
    pub fn config(&self) -> anyhow::Result<Option<ferry_router::config::AutoscaleConfig>> {
        if !self.autoscale {
            return Ok(None);
        }
        let path = self.autoscale_profile.as_ref().ok_or_else(|| anyhow::anyhow!("--autoscale needs --autoscale-profile"))?;
        anyhow::ensure!(self.autoscale_max_workers >= 2, "--autoscale-max-workers must be at least 2 (one of each role)");
        anyhow::ensure!(self.autoscale_interval_ms >= 100, "--autoscale-interval-ms must be at least 100");
        anyhow::ensure!((0.0..=1.0).contains(&self.slo.slo_target), "--slo-target must be a fraction in 0..=1");
        anyhow::ensure!(self.autoscale_headroom >= 0.0, "--autoscale-headroom must not be negative");
        let profile = crate::plan::read_profile(path)?;
        let fleet = crate::plan::fleet(&profile, None, 2.6, 1.0)?;
        let policy = Policy {
            slo: self.slo.slo(),
            target: self.slo.slo_target,
            max_workers: self.autoscale_max_workers,
            headroom: self.autoscale_headroom,
            up_cooldown: Duration::from_millis(self.autoscale_up_cooldown_ms),
            down_cooldown: Duration::from_millis(self.autoscale_down_cooldown_ms),
            down_after: self.autoscale_down_after,
            ..Policy::default()
        };
        Ok(Some(ferry_router::config::AutoscaleConfig {
            interval: Duration::from_millis(self.autoscale_interval_ms),
            rate_window: Duration::from_millis(self.autoscale_rate_window_ms),
            policy,
            fleet,
            calibrate: !self.autoscale_uncalibrated,
        }))
    }

    /// The SLO flags, for every router `ferry up` starts (each counts goodput against them).
    pub fn slo_args(&self) -> Vec<String> {
        vec![
            "--slo-ttft-ms".to_string(),
            self.slo.slo_ttft_ms.to_string(),
            "--slo-tpot-ms".to_string(),
            self.slo.slo_tpot_ms.to_string(),
            "--slo-target".to_string(),
            self.slo.slo_target.to_string(),
        ]
    }

    /// The autoscaling flags (the SLO's are [`Self::slo_args`]), for the router `ferry up`
    /// starts to scale the pools.
    pub fn to_args(&self) -> Vec<String> {
        if !self.autoscale {
            return Vec::new();
        }
        let mut v = vec!["--autoscale".to_string()];
        if let Some(p) = &self.autoscale_profile {
            let p = std::fs::canonicalize(p).unwrap_or_else(|_| p.clone());
            v.extend(["--autoscale-profile".to_string(), p.to_string_lossy().into_owned()]);
        }
        for (flag, value) in [
            ("--autoscale-interval-ms", self.autoscale_interval_ms.to_string()),
            ("--autoscale-rate-window-ms", self.autoscale_rate_window_ms.to_string()),
            ("--autoscale-max-workers", self.autoscale_max_workers.to_string()),
            ("--autoscale-headroom", self.autoscale_headroom.to_string()),
            ("--autoscale-up-cooldown-ms", self.autoscale_up_cooldown_ms.to_string()),
            ("--autoscale-down-cooldown-ms", self.autoscale_down_cooldown_ms.to_string()),
            ("--autoscale-down-after", self.autoscale_down_after.to_string()),
        ] {
            v.extend([flag.to_string(), value]);
        }
        if self.autoscale_uncalibrated {
            v.push("--autoscale-uncalibrated".into());
        }
        v
    }
}
