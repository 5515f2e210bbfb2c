//! `ferry up`'s supervisor: the router and worker processes it started, and the local scaler
//! (`ferry.v1.Scaler`) the router forwards `ferry pool scale` to. Scaling up starts workers like
//! the first ones; scaling down sends the newest workers of the pool SIGTERM, and each drains
//! itself (no new requests, in-flight ones and their KV finish) before it exits.

use anyhow::{bail, Context};
use ferry_proto::v1;
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

struct Proc {
    /// For messages: `router`, `prefill worker 1`, …
    what: String,
    /// Workers: their role; None for the router.
    role: Option<&'static str>,
    /// Told to drain and stop (scaled down): not counted in its pool any more.
    stopping: bool,
    exited: bool,
    child: Child,
}

/// How to start workers (the same way as the first ones).
pub struct WorkerTemplate {
    /// Arguments every worker gets (router, model, threads, transport, …).
    pub common: Vec<String>,
    pub chunked_prefill: Option<usize>,
    pub pin: bool,
    pub threads: usize,
    pub cores: usize,
    pub timeout: Duration,
    /// How long a scaled-down worker may drain (its `--drain-timeout`).
    pub drain_timeout: u64,
    /// Added to every worker's environment (the admin token: not on the command line).
    pub env: Vec<(&'static str, String)>,
}

/// The processes `ferry up` started; all stopped when this is dropped.
pub struct Supervisor {
    procs: Vec<Proc>,
    template: WorkerTemplate,
    next_index: HashMap<&'static str, usize>,
    next_cpu: usize,
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        // The router first (so no new work reaches the workers and nothing waits on their
        // leases), then the workers, each given a grace period to finish.
        for p in &mut self.procs {
            terminate(p.child.id());
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = p.child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            if let Ok(None) = p.child.try_wait() {
                let _ = p.child.kill();
            }
            let _ = p.child.wait();
        }
    }
}

fn terminate(pid: u32) {
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

pub fn role_name(role: v1::WorkerRole) -> Option<&'static str> {
    match role {
        v1::WorkerRole::Prefill => Some("prefill"),
        v1::WorkerRole::Decode => Some("decode"),
        v1::WorkerRole::Colocated => Some("colocated"),
        v1::WorkerRole::Unspecified => None,
    }
}

impl Supervisor {
    pub fn new(template: WorkerTemplate) -> Supervisor {
        Supervisor { procs: Vec::new(), template, next_index: HashMap::new(), next_cpu: 0 }
    }

    pub fn template_mut(&mut self) -> &mut WorkerTemplate {
        &mut self.template
    }

    /// Spawn `ferry ARGS` (with `env` added to its environment), wait for its `ready` line on stdout, and return it with ` pid=N`
    /// added; the rest of its stdout is forwarded to ours (so the pipe never fills).
    pub fn spawn(&mut self, what: String, role: Option<&'static str>, args: &[String], env: &[(&str, String)]) -> anyhow::Result<String> {
        let exe = std::env::current_exe()?;
        let mut cmd = Command::new(exe);
        cmd.args(args).envs(env.iter().map(|(k, v)| (k, v))).stdout(Stdio::piped()).stdin(Stdio::null());
        let mut child = cmd.spawn().with_context(|| format!("starting {what}"))?;
        let stdout = child.stdout.take().context("child stdout")?;
        let pid = child.id();
        self.procs.push(Proc { what: what.clone(), role, stopping: false, exited: false, child });
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
        let timeout = self.template.timeout;
        match rx.recv_timeout(timeout) {
            Ok(line) => Ok(format!("{line} pid={pid}")),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                // Its stdout closed before a `ready` line: it exited (a port in use, a bad flag…).
                let status = self.procs.last_mut().and_then(|p| p.child.wait().ok());
                let how = status.map_or_else(|| "exited".to_string(), |s| format!("exited ({s})"));
                bail!("{what} {how} before it was ready (see its error above)")
            }
            Err(mpsc::RecvTimeoutError::Timeout) => bail!("{what} did not become ready within {} s (see its log above)", timeout.as_secs()),
        }
    }

    /// Start one more worker of `role`; prints its `worker …` line and returns its name.
    pub fn start_worker(&mut self, role: &'static str) -> anyhow::Result<String> {
        // Numbered from 1, as the router numbers its worker ids: on a fresh cluster a worker's
        // name and its id (`prefill-1`) then agree in logs, `ferry pool list` and request summaries.
        let i = *self.next_index.entry(role).and_modify(|i| *i += 1).or_insert(1);
        let name = format!("{role}-{i}");
        let t = &self.template;
        let mut args = vec![role.to_string(), "--name".into(), name.clone()];
        args.extend(t.common.iter().cloned());
        args.extend(["--drain-timeout".into(), t.drain_timeout.to_string()]);
        if let Some(c) = t.chunked_prefill {
            match role {
                "colocated" => args.extend(["--chunked-prefill".into(), c.to_string()]),
                "prefill" => args.extend(["--max-batch-tokens".into(), c.to_string()]),
                _ => {}
            }
        }
        if t.pin {
            let first = self.next_cpu % t.cores;
            let cpus: Vec<String> = (0..t.threads).map(|k| ((first + k) % t.cores).to_string()).collect();
            self.next_cpu += t.threads;
            args.extend(["--cpus".into(), cpus.join(",")]);
        }
        let env = self.template.env.clone();
        let line = self.spawn(format!("{role} worker {i}"), Some(role), &args, &env)?;
        println!(
            "worker   role={role} name={name} pid={} grpc={} data={} metrics={}",
            field(&line, "pid=").unwrap_or("-"),
            field(&line, "grpc=").unwrap_or("-"),
            field(&line, "data=").unwrap_or("-"),
            field(&line, "metrics=").unwrap_or("-")
        );
        Ok(name)
    }

    /// Workers of `role` that are running and not told to stop, oldest first.
    fn pool(&self, role: &str) -> Vec<usize> {
        (0..self.procs.len()).filter(|&i| self.procs[i].role == Some(role) && !self.procs[i].stopping && !self.procs[i].exited).collect()
    }

    /// Grow or shrink `role`'s pool to `replicas` workers.
    pub fn scale(&mut self, role: &'static str, replicas: usize) -> anyhow::Result<v1::ScaleResponse> {
        let pool = self.pool(role);
        let previous = pool.len();
        let (mut started, mut stopping) = (Vec::new(), Vec::new());
        for _ in previous..replicas {
            started.push(self.start_worker(role)?);
        }
        // The newest go first; each drains itself on SIGTERM and exits when its work is done.
        for &i in pool.iter().rev().take(previous.saturating_sub(replicas)) {
            let p = &mut self.procs[i];
            p.stopping = true;
            terminate(p.child.id());
            println!("ferry up: {} told to drain and stop (pid {})", p.what, p.child.id());
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

    /// Reap children that exited; an error when the router did (it is essential). A worker that
    /// exits is routed around (the router drops it), so the rest keep serving.
    pub fn reap(&mut self) -> anyhow::Result<()> {
        for (i, p) in self.procs.iter_mut().enumerate() {
            if p.exited {
                continue;
            }
            if let Ok(Some(status)) = p.child.try_wait() {
                if i == 0 {
                    bail!("the router exited ({status}); stopping the workers");
                }
                p.exited = true;
                if p.stopping {
                    println!("ferry up: {} drained and exited ({status})", p.what);
                } else {
                    eprintln!("ferry up: {} exited ({status}); the others keep serving", p.what);
                }
            }
        }
        Ok(())
    }
}

/// `ferry.v1.Scaler`, served by `ferry up` on loopback for its router.
pub struct LocalScaler(pub Arc<Mutex<Supervisor>>);

#[tonic::async_trait]
impl v1::scaler_server::Scaler for LocalScaler {
    async fn scale(&self, req: tonic::Request<v1::ScaleRequest>) -> Result<tonic::Response<v1::ScaleResponse>, tonic::Status> {
        let r = req.into_inner();
        let wire = v1::WorkerRole::try_from(r.role).unwrap_or(v1::WorkerRole::Unspecified);
        let role = role_name(wire).ok_or_else(|| tonic::Status::invalid_argument("scale: the role is unspecified"))?;
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
