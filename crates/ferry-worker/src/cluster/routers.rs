//! A worker's routers: every router it is given, each with its own registration. `--router`
//! takes a comma-separated list of `host:port`; an entry whose name resolves to several
//! addresses (a Kubernetes headless Service over router replicas) counts as one router per
//! address. Names are re-resolved every [`RouterSetConfig::resolve_every`], so a new router pod
//! is picked up; an address that stops being listed is dropped once its link has also failed
//! for [`RouterSetConfig::forget_after`] (the configured names themselves are retried forever).
//!
//! The decision (which links to open, which to drop) is the pure [`plan`]; [`RouterSet`] applies
//! it. Readiness: ready while the lease with at least one router is current.
//!
//! An entry resolving to one address is dialled by its name (TLS checks the name as usual); one
//! resolving to several is dialled by IP, so a TLS router certificate must then name what
//! `--tls-server-name` says.

use crate::load::LoadGauge;
use super::registration::{self, keep_registered, LeaseFlag, RouterLink, WorkerId};
use ferry_proto::v1::RegisterRequest;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The entries of a `--router` list: trimmed, non-empty, each once, in order.
pub fn entries(list: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for e in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        if !out.iter().any(|o| o == e) {
            out.push(e.to_string());
        }
    }
    out
}

/// What resolving one entry gave.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resolved {
    Addrs(Vec<SocketAddr>),
    /// The name does not resolve now (DNS down, no pod yet).
    Failed,
}

/// A link the worker holds, as [`plan`] sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Known {
    /// The configured entry it came from.
    pub entry: String,
    /// Whether its lease is current.
    pub ready: bool,
    /// Since when its address has not been listed (None: listed at the last resolution).
    pub missing_since: Option<Instant>,
}

/// A link to open: `key` identifies the router (its address, or the entry while it does not
/// resolve), `dial` is what to connect to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Want {
    pub key: String,
    pub dial: String,
    pub entry: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub add: Vec<Want>,
    /// Links to close (and deregister).
    pub drop: Vec<String>,
    /// Links whose address is not listed any more, from now.
    pub missing: Vec<String>,
    /// Links listed again (their `missing_since` clears).
    pub present: Vec<String>,
}

/// The links to hold given what each entry resolves to now.
///
/// - an entry resolving to addresses: one link per address, keyed by the address;
/// - an entry that does not resolve: its links stay as they are; if it has none, one link keyed
///   and dialled by the entry itself (which keeps retrying the name);
/// - a link keyed by its entry goes as soon as that entry resolves (its addresses take over);
/// - a link whose address is no longer listed is dropped once it has been missing for
///   `forget_after` and its lease is not current; a live one stays until it fails.
pub fn plan(resolved: &[(String, Resolved)], known: &BTreeMap<String, Known>, now: Instant, forget_after: Duration) -> Plan {
    let mut listed: BTreeMap<String, Want> = BTreeMap::new();
    let mut kept: BTreeSet<String> = BTreeSet::new();
    for (entry, r) in resolved {
        match r {
            Resolved::Addrs(addrs) if !addrs.is_empty() => {
                for a in addrs {
                    let key = a.to_string();
                    let dial = if addrs.len() == 1 { entry.clone() } else { key.clone() };
                    listed.entry(key.clone()).or_insert(Want { key, dial, entry: entry.clone() });
                }
            }
            Resolved::Addrs(_) | Resolved::Failed => {
                let mine: Vec<&String> = known.iter().filter(|(_, k)| &k.entry == entry).map(|(key, _)| key).collect();
                if mine.is_empty() {
                    listed.insert(entry.clone(), Want { key: entry.clone(), dial: entry.clone(), entry: entry.clone() });
                } else {
                    kept.extend(mine.into_iter().cloned());
                }
            }
        }
    }
    let mut p = Plan::default();
    for (key, want) in &listed {
        if !known.contains_key(key) {
            p.add.push(want.clone());
        }
    }
    for (key, k) in known {
        // An entry that does not resolve now says nothing about its links: they stay as they are.
        if kept.contains(key) {
            continue;
        }
        if listed.contains_key(key) {
            if k.missing_since.is_some() {
                p.present.push(key.clone());
            }
            continue;
        }
        if key == &k.entry {
            // The entry's own placeholder: the entry resolves now, its addresses take over.
            p.drop.push(key.clone());
            continue;
        }
        match k.missing_since {
            None => p.missing.push(key.clone()),
            Some(t) if now.saturating_duration_since(t) >= forget_after && !k.ready => p.drop.push(key.clone()),
            Some(_) => {}
        }
    }
    p
}

/// How often names are resolved again, and how long a vanished, failing router is kept.
#[derive(Clone, Copy, Debug)]
pub struct RouterSetConfig {
    pub resolve_every: Duration,
    pub forget_after: Duration,
}

impl Default for RouterSetConfig {
    fn default() -> Self {
        RouterSetConfig { resolve_every: Duration::from_secs(1), forget_after: Duration::from_secs(30) }
    }
}

struct Link {
    entry: String,
    dial: String,
    id: WorkerId,
    ready: Arc<Flag>,
    missing_since: Option<Instant>,
    task: JoinHandle<()>,
}

/// One link's lease flag (a change recomputes the worker's readiness), and whether its router
/// has heard that the worker drains.
struct Flag {
    current: std::sync::atomic::AtomicBool,
    heard_drain: std::sync::atomic::AtomicBool,
    shared: std::sync::Weak<Shared>,
}

impl LeaseFlag for Flag {
    fn set(&self, current: bool) {
        self.current.store(current, std::sync::atomic::Ordering::SeqCst);
        if let Some(s) = self.shared.upgrade() {
            s.refresh();
        }
    }

    fn drain_heard(&self) {
        self.heard_drain.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

struct Shared {
    links: Mutex<BTreeMap<String, Link>>,
    /// The worker's readiness: true while any link's lease is current.
    ready: watch::Sender<bool>,
}

impl Shared {
    fn refresh(&self) {
        let any = self.lock().values().any(|l| l.ready.current.load(std::sync::atomic::Ordering::SeqCst));
        if self.ready.send_replace(any) != any {
            if any {
                tracing::info!("ready: registered with a router");
            } else {
                tracing::warn!("not ready: no current lease with any router");
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Link>> {
        self.links.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The links a worker holds to its routers, kept in line with what the entries resolve to.
pub struct RouterSet {
    shared: Arc<Shared>,
    link: RouterLink,
    /// The worker's gRPC address (deregistration names it).
    addr: String,
    resolver: JoinHandle<()>,
}

/// A router's address, as the worker saw it, and the id that router gave it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouterStatus {
    pub key: String,
    pub dial: String,
    pub worker_id: Option<String>,
    pub lease_current: bool,
}

impl RouterSet {
    /// Start: resolve `entries`, open a registration per router, keep them in line.
    /// `link` is the template (admin token, TLS); its `router` is replaced per link.
    pub fn spawn(
        entries: Vec<String>,
        link: RouterLink,
        template: RegisterRequest,
        load: Arc<LoadGauge>,
        ready: watch::Sender<bool>,
        draining: watch::Receiver<bool>,
        cfg: RouterSetConfig,
    ) -> RouterSet {
        let shared = Arc::new(Shared { links: Mutex::default(), ready });
        let addr = template.grpc_addr.clone();
        let (s, l) = (shared.clone(), link.clone());
        let resolver = tokio::spawn(async move {
            loop {
                let mut resolved = Vec::with_capacity(entries.len());
                for e in &entries {
                    resolved.push((e.clone(), resolve(e).await));
                }
                let known: BTreeMap<String, Known> = s
                    .lock()
                    .iter()
                    .map(|(k, v)| (k.clone(), Known { entry: v.entry.clone(), ready: v.ready.current.load(std::sync::atomic::Ordering::SeqCst), missing_since: v.missing_since }))
                    .collect();
                let p = plan(&resolved, &known, Instant::now(), cfg.forget_after);
                apply(&s, &l, &template, &load, &draining, p);
                tokio::time::sleep(cfg.resolve_every).await;
            }
        });
        RouterSet { shared, link, addr, resolver }
    }

    /// Each router's link, for logs and tests.
    pub fn status(&self) -> Vec<RouterStatus> {
        self.shared
            .lock()
            .iter()
            .map(|(k, l)| RouterStatus {
                key: k.clone(),
                dial: l.dial.clone(),
                worker_id: l.id.lock().unwrap_or_else(|p| p.into_inner()).clone(),
                lease_current: l.ready.current.load(std::sync::atomic::Ordering::SeqCst),
            })
            .collect()
    }

    /// Wait until every router this worker holds a current lease with has answered a message
    /// saying it drains, or failed to (a router that refuses the connection is not waited for),
    /// at most `bound`. True when all of them have.
    pub async fn drain_heard(&self, bound: Duration) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        let deadline = Instant::now() + bound;
        loop {
            let all = self.shared.lock().values().all(|l| !l.ready.current.load(SeqCst) || l.ready.heard_drain.load(SeqCst));
            if all {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Stop every link and deregister from every router that knows us (concurrently, each
    /// bounded).
    pub async fn deregister_all(self) {
        self.resolver.abort();
        let links: Vec<Link> = std::mem::take(&mut *self.shared.lock()).into_values().collect();
        let mut calls = tokio::task::JoinSet::new();
        for l in links {
            l.task.abort();
            let link = RouterLink { router: l.dial.clone(), ..self.link.clone() };
            let addr = self.addr.clone();
            calls.spawn(async move { registration::deregister(link, &l.id, addr).await });
        }
        while calls.join_next().await.is_some() {}
    }
}

impl Drop for RouterSet {
    fn drop(&mut self) {
        self.resolver.abort();
        for l in self.shared.lock().values() {
            l.task.abort();
        }
    }
}

fn apply(s: &Arc<Shared>, link: &RouterLink, template: &RegisterRequest, load: &Arc<LoadGauge>, draining: &watch::Receiver<bool>, p: Plan) {
    let mut links = s.lock();
    for key in &p.drop {
        if let Some(l) = links.remove(key) {
            tracing::warn!(router = %l.dial, "dropping the router link: its address is gone and it fails");
            l.task.abort();
            let link = RouterLink { router: l.dial.clone(), ..link.clone() };
            let addr = template.grpc_addr.clone();
            tokio::spawn(async move { registration::deregister(link, &l.id, addr).await });
        }
    }
    let now = Instant::now();
    for key in &p.missing {
        if let Some(l) = links.get_mut(key) {
            l.missing_since = Some(now);
        }
    }
    for key in &p.present {
        if let Some(l) = links.get_mut(key) {
            l.missing_since = None;
        }
    }
    for w in p.add {
        tracing::info!(router = %w.dial, entry = %w.entry, "registering with a router");
        let flag = Arc::new(Flag { current: false.into(), heard_drain: false.into(), shared: Arc::downgrade(s) });
        let id = WorkerId::default();
        let r = RouterLink { router: w.dial.clone(), ..link.clone() };
        let task = tokio::spawn(keep_registered(r, template.clone(), load.clone(), flag.clone(), draining.clone(), id.clone()));
        links.insert(w.key, Link { entry: w.entry, dial: w.dial, id, ready: flag, missing_since: None, task });
    }
    drop(links);
    s.refresh();
}

/// The addresses `entry` (`host:port`) resolves to now, each once (bounded: a DNS server that
/// does not answer counts as a failure).
async fn resolve(entry: &str) -> Resolved {
    match tokio::time::timeout(Duration::from_secs(2), tokio::net::lookup_host(entry)).await {
        Ok(Ok(addrs)) => {
            let mut v: Vec<SocketAddr> = Vec::new();
            for a in addrs {
                if !v.contains(&a) {
                    v.push(a);
                }
            }
            Resolved::Addrs(v)
        }
        Ok(Err(e)) => {
            tracing::debug!(%entry, "cannot resolve the router address: {e}");
            Resolved::Failed
        }
        Err(_) => Resolved::Failed,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(s: &str) -> SocketAddr {
        s.parse().expect("socket address")
    }

    fn known(entry: &str, ready: bool, missing_since: Option<Instant>) -> Known {
        Known { entry: entry.into(), ready, missing_since }
    }

    #[test]
    fn a_list_splits_on_commas_once_each() {
        assert_eq!(entries(" a:1, b:2,,a:1 ,c:3"), vec!["a:1", "b:2", "c:3"]);
        assert!(entries(" , ").is_empty());
    }

    #[test]
    fn the_plan_follows_the_names() {
        let t0 = Instant::now();
        let forget = Duration::from_secs(30);
        let later = t0 + Duration::from_secs(31);
        let svc = "routers:7700".to_string();
        let one = Resolved::Addrs(vec![addr("10.0.0.1:7700")]);
        let two = Resolved::Addrs(vec![addr("10.0.0.1:7700"), addr("10.0.0.2:7700")]);
        let none = BTreeMap::new();

        // One address: dialled by its name. Two: one link each, dialled by IP.
        let p = plan(&[(svc.clone(), one.clone())], &none, t0, forget);
        assert_eq!(p.add, vec![Want { key: "10.0.0.1:7700".into(), dial: svc.clone(), entry: svc.clone() }]);
        let p = plan(&[(svc.clone(), two.clone())], &none, t0, forget);
        assert_eq!(p.add.iter().map(|w| w.dial.as_str()).collect::<Vec<_>>(), vec!["10.0.0.1:7700", "10.0.0.2:7700"]);

        // A new pod appears: only it is added.
        let have: BTreeMap<String, Known> = [("10.0.0.1:7700".to_string(), known(&svc, true, None))].into();
        let p = plan(&[(svc.clone(), two.clone())], &have, t0, forget);
        assert_eq!(p.add.len(), 1);
        assert_eq!(p.add[0].key, "10.0.0.2:7700");
        assert!(p.drop.is_empty() && p.missing.is_empty());

        // A pod disappears: marked missing, dropped only once missing for a while AND failing.
        let have: BTreeMap<String, Known> = [
            ("10.0.0.1:7700".to_string(), known(&svc, true, None)),
            ("10.0.0.2:7700".to_string(), known(&svc, false, None)),
        ]
        .into();
        let p = plan(&[(svc.clone(), one.clone())], &have, t0, forget);
        assert_eq!(p.missing, vec!["10.0.0.2:7700"]);
        assert!(p.drop.is_empty());
        let gone = |ready| -> BTreeMap<String, Known> {
            [("10.0.0.1:7700".to_string(), known(&svc, true, None)), ("10.0.0.2:7700".to_string(), known(&svc, ready, Some(t0)))].into()
        };
        assert!(plan(&[(svc.clone(), one.clone())], &gone(false), t0 + Duration::from_secs(5), forget).drop.is_empty(), "not for long enough");
        assert_eq!(plan(&[(svc.clone(), one.clone())], &gone(false), later, forget).drop, vec!["10.0.0.2:7700"]);
        assert!(plan(&[(svc.clone(), one.clone())], &gone(true), later, forget).drop.is_empty(), "a live router stays");
        // Listed again: present.
        assert_eq!(plan(&[(svc.clone(), two.clone())], &gone(false), later, forget).present, vec!["10.0.0.2:7700"]);

        // The name does not resolve: what we have stays; with nothing, the name itself is tried.
        let p = plan(&[(svc.clone(), Resolved::Failed)], &gone(false), later, forget);
        assert_eq!(p, Plan::default());
        let p = plan(&[(svc.clone(), Resolved::Failed)], &none, t0, forget);
        assert_eq!(p.add, vec![Want { key: svc.clone(), dial: svc.clone(), entry: svc.clone() }]);
        // ... and once it resolves, its addresses replace that placeholder.
        let have: BTreeMap<String, Known> = [(svc.clone(), known(&svc, false, None))].into();
        let p = plan(&[(svc.clone(), one.clone())], &have, t0, forget);
        assert_eq!(p.drop, vec![svc.clone()]);
        assert_eq!(p.add.len(), 1);

        // Two entries are independent.
        let other = "10.0.0.9:7700".to_string();
        let p = plan(&[(svc.clone(), Resolved::Failed), (other.clone(), Resolved::Addrs(vec![addr(&other)]))], &none, t0, forget);
        assert_eq!(p.add.iter().map(|w| w.key.as_str()).collect::<Vec<_>>(), vec!["10.0.0.9:7700", "routers:7700"]);
    }
}
