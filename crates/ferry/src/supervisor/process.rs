//! One process `ferry up` supervises: its state (starting, running, stopping, waiting to be
//! restarted, gone), how it is launched, announced and stopped, and what its exit means
//! ([`super::restart`]).

use super::restart::{self, Backoff, Decision, Exit};
use anyhow::Context;
use ferry_core::WorkerRole;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

/// What a supervised process is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// The i-th router, from 1.
    Router(usize),
    Worker(WorkerRole),
}

pub(super) enum State {
    /// Started; its `ready` line has not come yet.
    Starting { child: Child, ready: Receiver<String> },
    Running(Child),
    /// Told to drain and stop (scaled down): not counted in its pool any more.
    Stopping(Child),
    /// Exited unexpectedly; started again at this instant.
    Waiting(Instant),
    /// Exited, and not started again.
    Gone,
}

pub(super) struct Proc {
    pub(super) kind: Kind,
    /// `router-1`, `decode-2` (a worker's `--name`).
    pub(super) name: String,
    /// For the scaler's answer: `decode worker 2`.
    pub(super) what: String,
    pub(super) args: Vec<String>,
    pub(super) env: Vec<(&'static str, String)>,
    pub(super) state: State,
    /// When the current child started.
    pub(super) started: Instant,
    /// When the current child became ready (None before): a failure's uptime counts from here.
    pub(super) up_since: Option<Instant>,
    pub(super) restarts: u32,
    pub(super) backoff: Backoff,
    /// A worker's slot in its pool (from 1; 0 for a router): what names its per-worker state.
    pub(super) slot: usize,
}

impl Proc {
    /// For messages: `worker decode-2`, `router 1`.
    pub(super) fn label(&self) -> String {
        match self.kind {
            Kind::Router(i) => format!("router {i}"),
            Kind::Worker(_) => format!("worker {}", self.name),
        }
    }

    pub(super) fn child(&mut self) -> Option<&mut Child> {
        match &mut self.state {
            State::Starting { child, .. } | State::Running(child) | State::Stopping(child) => Some(child),
            State::Waiting(_) | State::Gone => None,
        }
    }

    /// Print the announcement line for a (re)started process, from its own `ready` line.
    pub(super) fn announce(&self, pid: u32, ready: &str) {
        let f = |key| field(ready, key).unwrap_or("-");
        match self.kind {
            Kind::Router(_) => println!(
                "router   name={} pid={pid} grpc={} http={} metrics={} restarts={}",
                self.name,
                f("grpc="),
                f("http="),
                f("metrics="),
                self.restarts
            ),
            Kind::Worker(role) => println!(
                "worker   role={role} name={} pid={pid} grpc={} data={} metrics={} restarts={}",
                self.name,
                f("grpc="),
                f("data="),
                f("metrics="),
                self.restarts
            ),
        }
    }

    /// The child exited with `status`: what its state becomes.
    pub(super) fn exited(&mut self, pid: u32, status: std::process::ExitStatus, told_to_stop: bool, restarts_on: bool, now: Instant) -> State {
        let exit = Exit::of(status);
        let label = self.label();
        match restart::decide(exit, told_to_stop, restarts_on) {
            Decision::Restart => {
                let uptime = self.up_since.take().map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
                let delay = self.backoff.delay(uptime);
                self.restarts += 1;
                eprintln!(
                    "ferry up: {label} (pid {pid}) exited unexpectedly ({exit}); restarting in {:.1} s (restart {})",
                    delay.as_secs_f64(),
                    self.restarts
                );
                State::Waiting(now + delay)
            }
            Decision::Stopped => {
                println!("ferry up: {label} drained and exited ({exit})");
                State::Gone
            }
            Decision::LeftCleanly => {
                eprintln!("ferry up: {label} (pid {pid}) exited on its own ({exit}); not restarting it");
                State::Gone
            }
            Decision::StaysDown => {
                eprintln!("ferry up: {label} (pid {pid}) exited unexpectedly ({exit}); not restarting it (--no-restart)");
                State::Gone
            }
        }
    }
}

/// SIGTERM every process, then SIGKILL what is left after 10 s.
pub(super) fn stop_all(procs: Vec<&mut Proc>) {
    let mut children: Vec<&mut Child> = procs.into_iter().filter_map(Proc::child).collect();
    for c in &children {
        terminate(c.id());
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline && children.iter_mut().any(|c| matches!(c.try_wait(), Ok(None))) {
        std::thread::sleep(Duration::from_millis(10));
    }
    for c in &mut children {
        if let Ok(None) = c.try_wait() {
            let _ = c.kill();
        }
        let _ = c.wait();
    }
}

pub(super) fn terminate(pid: u32) {
    // SAFETY: kill(2) with a pid this process spawned and SIGTERM; no memory is involved.
    #[cfg(unix)]
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGTERM);
    }
    #[cfg(not(unix))]
    let _ = pid;
}

pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|f| f.strip_prefix(key))
}

/// Spawn `ferry ARGS` (with `env` added to its environment). The receiver gets its `ready` line;
/// the rest of its stdout is forwarded to ours (so the pipe never fills).
pub(super) fn launch(args: &[String], env: &[(&'static str, String)]) -> anyhow::Result<(Child, Receiver<String>)> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    // The cluster secret reaches a child as FERRY_CLUSTER_SECRET in `env`, never as a file
    // variable inherited beside it (which it would refuse as ambiguous).
    cmd.args(args).env_remove("FERRY_CLUSTER_SECRET_FILE").envs(env.iter().map(|(k, v)| (k, v))).stdout(Stdio::piped()).stdin(Stdio::null());
    let mut child = cmd.spawn()?;
    let stdout = child.stdout.take().context("child stdout")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut first = true;
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if first && line.contains(" ready ") {
                first = false;
                let _ = tx.send(line);
            } else {
                println!("{line}");
            }
        }
    });
    Ok((child, rx))
}
