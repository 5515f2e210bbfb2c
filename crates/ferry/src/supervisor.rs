//! `ferry up`'s supervisor: the router and worker processes it started, and the local scaler
//! (`ferry.v1.Scaler`) every router forwards `ferry pool scale` to. Scaling up starts workers like
//! the first ones; scaling down sends the newest workers of the pool SIGTERM, and each drains
//! itself (no new requests, in-flight ones and their KV finish) before it exits. A process that
//! exits unexpectedly is started again with the same arguments after a backoff ([`restart`]): a
//! worker registers anew, a router comes back on the same ports (the workers were given them).
//!
//! Every (re)started process is announced on stdout in one machine-readable line, which
//! `tests/cluster_support.rs` parses:
//! `router   name=router-1 pid=N grpc=ADDR http=ADDR metrics=ADDR restarts=0`,
//! `worker   role=decode name=decode-1 pid=N grpc=ADDR data=ADDR metrics=ADDR restarts=0`.

mod process;
mod restart;

use anyhow::{bail, Context};
use ferry_core::WorkerRole;
use ferry_proto::v1;
use process::{launch, stop_all, terminate, Kind, Proc, State};
pub use process::field;
use restart::{Backoff, BackoffPolicy, Exit};
use std::collections::HashMap;
use std::sync::mpsc::{RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How to start workers (the same way as the first ones).
pub struct WorkerTemplate {
    /// Arguments every worker gets (routers, model, threads, transport, …).
    pub common: Vec<String>,
    /// Arguments decode and colocated workers get besides (speculation).
    pub decoding: Vec<String>,
    pub chunked_prefill: Option<usize>,
    pub pin: bool,
    pub threads: usize,
    pub cores: usize,
    /// How long a process may take to print its `ready` line.
    pub timeout: Duration,
    /// How long a scaled-down worker may drain (its `--drain-timeout`).
    pub drain_timeout: u64,
    /// Added to every worker's environment (the admin token: not on the command line).
    pub env: Vec<(&'static str, String)>,
    /// A worker's own arguments by its slot's name (`prefill-1`: `--kv-disk` in a subfolder of
    /// that name). A restarted worker keeps its slot, so it finds its blocks again; a worker
    /// started after a scale-down takes the lowest slot free (see [`lowest_free_slot`]), so it
    /// finds a retired worker's blocks, and the folders never outnumber the most workers the pool
    /// had at once.
    pub per_worker: Box<dyn Fn(&str) -> Vec<String> + Send>,
}

/// A router's bound addresses, from its ready line.
pub struct RouterAddrs {
    pub grpc: String,
    pub http: String,
    pub metrics: String,
}

/// The processes `ferry up` started; all stopped when this is dropped.
pub struct Supervisor {
    procs: Vec<Proc>,
    template: WorkerTemplate,
    next_index: HashMap<WorkerRole, usize>,
    next_cpu: usize,
    /// Restart processes that exit unexpectedly (off with `--no-restart`).
    restarts_on: bool,
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        // The routers first (so no new work reaches the workers and nothing waits on their
        // leases), then the workers, each given a grace period to finish.
        let (routers, workers): (Vec<&mut Proc>, Vec<&mut Proc>) = self.procs.iter_mut().partition(|p| matches!(p.kind, Kind::Router(_)));
        stop_all(routers);
        stop_all(workers);
    }
}

/// Replace the value after `flag` in `args` (or append both).
fn set_flag(args: &mut Vec<String>, flag: &str, value: &str) {
    match args.iter().position(|a| a == flag) {
        Some(i) if i + 1 < args.len() => args[i + 1] = value.to_string(),
        _ => args.extend([flag.to_string(), value.to_string()]),
    }
}

pub fn role_of(role: v1::WorkerRole) -> Option<WorkerRole> {
    match role {
        v1::WorkerRole::Prefill => Some(WorkerRole::Prefill),
        v1::WorkerRole::Decode => Some(WorkerRole::Decode),
        v1::WorkerRole::Colocated => Some(WorkerRole::Colocated),
        v1::WorkerRole::Unspecified => None,
    }
}

impl Supervisor {
    pub fn new(template: WorkerTemplate, restarts_on: bool) -> Supervisor {
        Supervisor { procs: Vec::new(), template, next_index: HashMap::new(), next_cpu: 0, restarts_on }
    }

    pub fn template_mut(&mut self) -> &mut WorkerTemplate {
        &mut self.template
    }

    /// Add a process and start it; it is `Starting` until its ready line comes.
    fn add(&mut self, kind: Kind, name: String, what: String, args: Vec<String>, env: Vec<(&'static str, String)>, slot: usize) -> anyhow::Result<usize> {
        let (child, ready) = launch(&args, &env).with_context(|| format!("starting {what}"))?;
        let backoff = Backoff::new(BackoffPolicy::default());
        let state = State::Starting { child, ready };
        self.procs.push(Proc { kind, name, what, args, env, state, started: Instant::now(), up_since: None, restarts: 0, backoff, slot });
        Ok(self.procs.len() - 1)
    }

    /// Block until process `i` is ready; returns its ready line. A process that exits first or
    /// takes too long is gone (an error: this is the first start, or a scale-up someone waits on).
    fn wait_ready(&mut self, i: usize) -> anyhow::Result<String> {
        let timeout = self.template.timeout;
        let p = &mut self.procs[i];
        let State::Starting { child, ready } = std::mem::replace(&mut p.state, State::Gone) else {
            bail!("{} is not starting", p.what);
        };
        let mut child = child;
        match ready.recv_timeout(timeout) {
            Ok(line) => {
                p.announce(child.id(), &line);
                p.up_since = Some(Instant::now());
                p.state = State::Running(child);
                Ok(line)
            }
            Err(RecvTimeoutError::Disconnected) => {
                // Its stdout closed before a `ready` line: it exited (a port in use, a bad flag…).
                let how = child.wait().map_or_else(|_| "exited".to_string(), |s| format!("exited ({})", Exit::of(s)));
                bail!("{} {how} before it was ready (see its error above)", p.what)
            }
            Err(RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("{} did not become ready within {} s (see its log above)", p.what, timeout.as_secs())
            }
        }
    }

    /// Start router number `routers + 1` with `args` (`router --listen … --http-listen …
    /// --metrics-listen …`) and wait until it serves. Its restarts reuse the ports it bound.
    pub fn start_router(&mut self, mut args: Vec<String>, env: Vec<(&'static str, String)>) -> anyhow::Result<RouterAddrs> {
        let n = 1 + self.procs.iter().filter(|p| matches!(p.kind, Kind::Router(_))).count();
        let i = self.add(Kind::Router(n), format!("router-{n}"), format!("router {n}"), args.clone(), env, 0)?;
        let line = self.wait_ready(i)?;
        let addrs = RouterAddrs {
            grpc: field(&line, "grpc=").context("the router's ready line has no grpc=")?.to_string(),
            http: field(&line, "http=").unwrap_or("-").to_string(),
            metrics: field(&line, "metrics=").unwrap_or("-").to_string(),
        };
        for (flag, addr) in [("--listen", &addrs.grpc), ("--http-listen", &addrs.http), ("--metrics-listen", &addrs.metrics)] {
            if addr != "-" {
                set_flag(&mut args, flag, addr);
            }
        }
        self.procs[i].args = args;
        Ok(addrs)
    }

    /// Start one more worker of `role` and wait until it is ready; returns its name.
    pub fn start_worker(&mut self, role: WorkerRole) -> anyhow::Result<String> {
        // Numbered from 1, as the router numbers its worker ids: on a fresh cluster a worker's
        // name and its id (`prefill-1`) then agree in logs, `ferry pool list` and request summaries.
        let i = *self.next_index.entry(role).and_modify(|i| *i += 1).or_insert(1);
        let name = format!("{role}-{i}");
        let t = &self.template;
        let mut args = vec![role.to_string(), "--name".into(), name.clone()];
        args.extend(t.common.iter().cloned());
        args.extend(["--drain-timeout".into(), t.drain_timeout.to_string()]);
        // Slots held by workers of the role that run, start, wait to restart or drain (a
        // draining one holds its folder's lock until it exits).
        let held = self.procs.iter().filter(|p| p.kind == Kind::Worker(role) && !matches!(p.state, State::Gone)).map(|p| p.slot);
        let slot = lowest_free_slot(held);
        args.extend((t.per_worker)(&format!("{role}-{slot}")));
        if role != WorkerRole::Prefill {
            args.extend(t.decoding.iter().cloned());
        }
        if let Some(c) = t.chunked_prefill {
            match role {
                WorkerRole::Colocated => args.extend(["--chunked-prefill".into(), c.to_string()]),
                WorkerRole::Prefill => args.extend(["--max-batch-tokens".into(), c.to_string()]),
                WorkerRole::Decode => {}
            }
        }
        if t.pin {
            let first = self.next_cpu % t.cores;
            let cpus: Vec<String> = (0..t.threads).map(|k| ((first + k) % t.cores).to_string()).collect();
            self.next_cpu += t.threads;
            args.extend(["--cpus".into(), cpus.join(",")]);
        }
        let env = self.template.env.clone();
        let p = self.add(Kind::Worker(role), name.clone(), format!("{role} worker {i}"), args, env, slot)?;
        self.wait_ready(p)?;
        Ok(name)
    }

    /// Workers of `role` that run, start, or wait to restart, and were not told to stop; oldest first.
    fn pool(&self, role: WorkerRole) -> Vec<usize> {
        (0..self.procs.len())
            .filter(|&i| self.procs[i].kind == Kind::Worker(role))
            .filter(|&i| matches!(self.procs[i].state, State::Starting { .. } | State::Running(_) | State::Waiting(_)))
            .collect()
    }

    /// Grow or shrink `role`'s pool to `replicas` workers.
    pub fn scale(&mut self, role: WorkerRole, replicas: usize) -> anyhow::Result<v1::ScaleResponse> {
        let pool = self.pool(role);
        let previous = pool.len();
        let (mut started, mut stopping) = (Vec::new(), Vec::new());
        for _ in previous..replicas {
            started.push(self.start_worker(role)?);
        }
        // The newest go first; each drains itself on SIGTERM and exits when its work is done.
        for &i in pool.iter().rev().take(previous.saturating_sub(replicas)) {
            let p = &mut self.procs[i];
            match std::mem::replace(&mut p.state, State::Gone) {
                State::Starting { child, .. } | State::Running(child) | State::Stopping(child) => {
                    terminate(child.id());
                    println!("ferry up: {} told to drain and stop (pid {})", p.what, child.id());
                    p.state = State::Stopping(child);
                }
                State::Waiting(_) | State::Gone => println!("ferry up: {} is not restarted (scaled down)", p.what),
            }
            stopping.push(p.what.clone());
        }
        Ok(v1::ScaleResponse {
            role: 0,
            previous: previous as u32,
            replicas: replicas as u32,
            backend: format!("ferry up (pid {})", std::process::id()),
            started,
            stopping,
        })
    }

    /// Reap children that exited (restarting those that failed, after their backoff), announce
    /// restarted ones that became ready. An error once no router is left, none to be restarted.
    pub fn reap(&mut self) -> anyhow::Result<()> {
        let now = Instant::now();
        for i in 0..self.procs.len() {
            self.step(i, now);
        }
        let router_left = self.procs.iter().any(|p| matches!(p.kind, Kind::Router(_)) && !matches!(p.state, State::Gone | State::Stopping(_)));
        if !router_left {
            bail!("no router is left; stopping the workers");
        }
        Ok(())
    }

    fn step(&mut self, i: usize, now: Instant) {
        let (timeout, restarts_on) = (self.template.timeout, self.restarts_on);
        let p = &mut self.procs[i];
        p.state = match std::mem::replace(&mut p.state, State::Gone) {
            State::Starting { mut child, ready } => match child.try_wait() {
                Ok(Some(status)) => p.exited(child.id(), status, false, restarts_on, now),
                _ => match ready.try_recv() {
                    Ok(line) => {
                        p.announce(child.id(), &line);
                        p.up_since = Some(now);
                        State::Running(child)
                    }
                    Err(TryRecvError::Empty) if now.saturating_duration_since(p.started) > timeout => {
                        eprintln!("ferry up: {} (pid {}) was not ready within {} s; killing it", p.label(), child.id(), timeout.as_secs());
                        let _ = child.kill();
                        State::Starting { child, ready }
                    }
                    // Not ready yet, or its stdout closed: the exit shows on a later tick.
                    Err(_) => State::Starting { child, ready },
                },
            },
            State::Running(mut child) => match child.try_wait() {
                Ok(Some(status)) => p.exited(child.id(), status, false, restarts_on, now),
                _ => State::Running(child),
            },
            State::Stopping(mut child) => match child.try_wait() {
                Ok(Some(status)) => p.exited(child.id(), status, true, restarts_on, now),
                _ => State::Stopping(child),
            },
            State::Waiting(at) if now >= at => match launch(&p.args, &p.env) {
                Ok((child, ready)) => {
                    p.started = now;
                    p.up_since = None;
                    State::Starting { child, ready }
                }
                Err(e) => {
                    let delay = p.backoff.delay(Duration::ZERO);
                    eprintln!("ferry up: restarting {}: {e:#}; trying again in {:.1} s", p.label(), delay.as_secs_f64());
                    State::Waiting(now + delay)
                }
            },
            s => s,
        };
    }
}

/// `ferry.v1.Scaler`, served by `ferry up` on loopback for its routers.
pub struct LocalScaler(pub Arc<Mutex<Supervisor>>);

#[tonic::async_trait]
impl v1::scaler_server::Scaler for LocalScaler {
    async fn scale(&self, req: tonic::Request<v1::ScaleRequest>) -> Result<tonic::Response<v1::ScaleResponse>, tonic::Status> {
        let r = req.into_inner();
        let wire = v1::WorkerRole::try_from(r.role).unwrap_or(v1::WorkerRole::Unspecified);
        let role = role_of(wire).ok_or_else(|| tonic::Status::invalid_argument("scale: the role is unspecified"))?;
        // The router's cap, applied here too: the scaler is a port of its own.
        let cap = ferry_router::ops::scale::MAX_REPLICAS;
        if r.replicas > cap {
            return Err(tonic::Status::invalid_argument(format!("scale: {} replicas is more than the limit of {cap}", r.replicas)));
        }
        let sup = self.0.clone();
        // Starting a worker blocks until it has loaded its model.
        let out = tokio::task::spawn_blocking(move || sup.lock().unwrap_or_else(|p| p.into_inner()).scale(role, r.replicas as usize))
            .await
            .map_err(|e| tonic::Status::internal(format!("scaling: {e}")))?;
        match out {
            Ok(mut resp) => {
                resp.role = wire as i32;
                Ok(tonic::Response::new(resp))
            }
            Err(e) => Err(tonic::Status::internal(format!("scaling the {role} pool: {e:#}"))),
        }
    }
}

/// The lowest slot, from 1, not among `held`.
fn lowest_free_slot(held: impl Iterator<Item = usize>) -> usize {
    let held: std::collections::HashSet<usize> = held.collect();
    (1..).find(|k| !held.contains(k)).unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_flag_replaces_or_appends() {
        let mut a: Vec<String> = ["router", "--listen", "127.0.0.1:0", "--model", "m"].map(String::from).into();
        set_flag(&mut a, "--listen", "127.0.0.1:7700");
        set_flag(&mut a, "--metrics-listen", "127.0.0.1:9");
        assert_eq!(a, ["router", "--listen", "127.0.0.1:7700", "--model", "m", "--metrics-listen", "127.0.0.1:9"]);
    }

    #[test]
    fn a_new_worker_takes_the_lowest_slot_no_live_worker_holds() {
        assert_eq!(lowest_free_slot([].into_iter()), 1);
        assert_eq!(lowest_free_slot([1, 2, 3].into_iter()), 4);
        // prefill-2 was scaled down and is gone: the next worker gets its slot (and its folder).
        assert_eq!(lowest_free_slot([1, 3].into_iter()), 2);
        // Slot 0 is the routers'; it never counts.
        assert_eq!(lowest_free_slot([0, 2].into_iter()), 1);
    }
}
