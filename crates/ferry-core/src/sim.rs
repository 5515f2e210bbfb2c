//! `ferry plan`'s discrete-event simulation of a router and its pools (DistServe, arXiv:2401.09670
//! §4.2, places its pools with a simulator of the same kind).
//!
//! What is simulated is Ferry's own decisions, called here as the workers and the router call
//! them: the router's decode admission ([`crate::routing::rank_decode`] over blocks reserved with
//! [`crate::routing::blocks_needed`], waiting FIFO when no worker has room) and prefill pick
//! ([`crate::routing::pick_prefill`]); a prefill worker's prompt admission and batches
//! ([`crate::schedule::admit_prompt`], [`crate::schedule::plan_prefill`]); a decode or colocated
//! worker's steps ([`crate::schedule::plan_step`]). What is *modelled* is time: each step lasts what
//! the [`CostModel`] fitted to the machine's profile says, and a KV transfer what the [`KvLink`]
//! says. Not modelled: the router's own latency, heartbeat lag, prefix caches, failures, and
//! processes sharing cores (each worker is assumed to own its compute, as with `ferry up --pin`).

use crate::slo::{attainment, percentile, Sample, Slo};
use crate::profile::CostModel;
use crate::routing::{blocks_needed, pick_prefill, rank_decode, DecodeCandidate, PrefillCandidate, WorkerState};
use crate::schedule::{admit_prompt, plan_prefill, plan_step, Admit, PromptLeft, StepPlan, StepPolicy};
use serde::Serialize;
use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};

/// One request of a simulated workload.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct SimRequest {
    /// Seconds after the start.
    pub at: f64,
    /// Prompt tokens.
    pub prompt: usize,
    /// Tokens generated (end of sequence ignored).
    pub output: usize,
}

/// How a budget of workers is spent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Split {
    /// `prefill` prefill workers and `decode` decode workers.
    Disaggregated { prefill: usize, decode: usize },
    /// `workers` colocated workers (prefill and decode in one loop each).
    Colocated { workers: usize },
}

impl Split {
    pub fn workers(&self) -> usize {
        match *self {
            Split::Disaggregated { prefill, decode } => prefill + decode,
            Split::Colocated { workers } => workers,
        }
    }

    /// Every way to spend `n` workers: each `P:D` with at least one of each, then `n` colocated.
    pub fn all(n: usize) -> Vec<Split> {
        let mut out: Vec<Split> = (1..n).map(|p| Split::Disaggregated { prefill: p, decode: n - p }).collect();
        if n > 0 {
            out.push(Split::Colocated { workers: n });
        }
        out
    }
}

impl std::fmt::Display for Split {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Split::Disaggregated { prefill, decode } => write!(f, "{prefill}P:{decode}D"),
            Split::Colocated { workers } => write!(f, "{workers} colocated"),
        }
    }
}

/// What moving a prompt's KV from a prefill to a decode worker costs.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct KvLink {
    pub bytes_per_token: usize,
    /// Sustained bytes per second (`ferry bench kv` measures it).
    pub bytes_per_s: f64,
    /// Fixed seconds per transfer (connection, acknowledgement).
    pub latency_s: f64,
}

impl KvLink {
    /// Seconds from the end of a prompt's last prefill step until its KV is in place on the
    /// decode worker (layer-wise streaming hides the rest behind the step; this counts the whole
    /// body, an upper bound).
    pub fn seconds(&self, tokens: usize) -> f64 {
        self.latency_s + (tokens * self.bytes_per_token) as f64 / self.bytes_per_s.max(1.0)
    }
}

/// The workers every split is made of (all alike: one profile).
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Fleet {
    pub cost: CostModel,
    pub block_size: usize,
    /// KV blocks per worker.
    pub kv_blocks: usize,
    pub max_batch_tokens: usize,
    pub max_context: usize,
    /// Colocated workers' chunked-prefill budget (`--chunked-prefill`); None: prefill first.
    pub chunk_tokens: Option<usize>,
    pub kv: KvLink,
    /// How long steps take against the profile, per role (1: as profiled).
    pub calibration: Calibration,
}

/// Measured step time ÷ the profile's, per role: 1.3 prices every step of that role 30% longer
/// than the cost model does. The workers measure it as they run (`--profile`: they price each
/// step against the cost model), so a plan can be made for the device as it runs now rather than
/// as it ran when profiled.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Calibration {
    pub prefill: f64,
    pub decode: f64,
    pub colocated: f64,
}

impl Calibration {
    /// Steps as the profile says.
    pub const PROFILED: Calibration = Calibration { prefill: 1.0, decode: 1.0, colocated: 1.0 };

    pub fn of(&self, role: crate::WorkerRole) -> f64 {
        match role {
            crate::WorkerRole::Prefill => self.prefill,
            crate::WorkerRole::Decode => self.decode,
            crate::WorkerRole::Colocated => self.colocated,
        }
    }

    pub fn is_profiled(&self) -> bool {
        *self == Calibration::PROFILED
    }
}

impl Default for Calibration {
    fn default() -> Self {
        Calibration::PROFILED
    }
}

/// Run `requests` (sorted by arrival) through `split`; one [`Sample`] per request, in order.
pub fn simulate(fleet: &Fleet, split: Split, requests: &[SimRequest]) -> Vec<Sample> {
    Sim::new(fleet, split, requests).run()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Prefill,
    Decode,
    Colocated,
}

#[derive(Clone, Copy, Debug)]
enum Event {
    Arrive(usize),
    StepDone(usize),
    /// Request `r`'s KV landed on its decode worker; its prefill worker's lease ends.
    KvLanded(usize),
}

struct Timed {
    t: f64,
    seq: u64,
    ev: Event,
}

impl PartialEq for Timed {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Timed {}
impl PartialOrd for Timed {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Timed {
    /// Reversed: the heap pops the earliest (then the first scheduled).
    fn cmp(&self, o: &Self) -> Ordering {
        o.t.total_cmp(&self.t).then(o.seq.cmp(&self.seq))
    }
}

#[derive(Clone, Default)]
struct Req {
    prefill: Option<usize>,
    decode: usize,
    reserved: u32,
    first: Option<f64>,
    last: f64,
    count: usize,
    done: bool,
    failed: bool,
}

/// A prompt being computed.
struct Pre {
    r: usize,
    done: usize,
}

/// A sequence decoding.
struct Run {
    r: usize,
    count: usize,
}

/// The step a worker is running.
enum Step {
    Prefill(Vec<(usize, usize)>),
    Mixed(StepPlan),
}

struct Worker {
    role: Role,
    step: Option<Step>,
    /// Prefill: prompts waiting to start.
    queue: VecDeque<usize>,
    /// Prompts started (prefill worker) or prefilling here (colocated), in order.
    active: Vec<Pre>,
    running: Vec<Run>,
    rotate: usize,
    /// Prefill: blocks held by finished prompts until their KV lands.
    leased: usize,
    /// Router's view: prompt tokens sent and not yet prefilled; requests in flight; blocks promised.
    outstanding: u64,
    inflight: u32,
    promised: u32,
}

struct Sim<'a> {
    fleet: &'a Fleet,
    reqs: &'a [SimRequest],
    state: Vec<Req>,
    workers: Vec<Worker>,
    events: BinaryHeap<Timed>,
    seq: u64,
    now: f64,
    /// Requests no decode (colocated) worker had room for yet, in arrival order.
    waiting: VecDeque<usize>,
    colocated: bool,
}

impl<'a> Sim<'a> {
    fn new(fleet: &'a Fleet, split: Split, reqs: &'a [SimRequest]) -> Self {
        let worker = |role| Worker {
            role,
            step: None,
            queue: VecDeque::new(),
            active: Vec::new(),
            running: Vec::new(),
            rotate: 0,
            leased: 0,
            outstanding: 0,
            inflight: 0,
            promised: 0,
        };
        let (workers, colocated): (Vec<Worker>, bool) = match split {
            Split::Disaggregated { prefill, decode } => {
                (std::iter::repeat_with(|| worker(Role::Prefill)).take(prefill).chain(std::iter::repeat_with(|| worker(Role::Decode)).take(decode)).collect(), false)
            }
            Split::Colocated { workers } => (std::iter::repeat_with(|| worker(Role::Colocated)).take(workers).collect(), true),
        };
        let mut sim = Sim { fleet, reqs, state: vec![Req::default(); reqs.len()], workers, events: BinaryHeap::new(), seq: 0, now: 0.0, waiting: VecDeque::new(), colocated };
        for (i, r) in reqs.iter().enumerate() {
            sim.at(r.at, Event::Arrive(i));
        }
        sim
    }

    fn at(&mut self, t: f64, ev: Event) {
        self.seq += 1;
        self.events.push(Timed { t, seq: self.seq, ev });
    }

    fn run(mut self) -> Vec<Sample> {
        while let Some(Timed { t, ev, .. }) = self.events.pop() {
            self.now = t;
            match ev {
                Event::Arrive(r) => {
                    self.waiting.push_back(r);
                    self.admit_waiting();
                }
                Event::StepDone(w) => self.step_done(w),
                Event::KvLanded(r) => self.kv_landed(r),
            }
        }
        self.reqs
            .iter()
            .zip(&self.state)
            .map(|(q, s)| {
                let ok = s.done && !s.failed;
                let first = s.first.unwrap_or(f64::INFINITY);
                let tpot = if s.count > 1 { (s.last - first) / (s.count - 1) as f64 } else { 0.0 };
                Sample { ok, ttft_ms: (first - q.at) * 1e3, tpot_ms: tpot * 1e3, e2e_ms: (s.last - q.at) * 1e3, output_tokens: s.count }
            })
            .collect()
    }

    fn blocks(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.fleet.block_size.max(1))
    }

    /// The router: the head of the line goes to the decode (colocated) worker with the most room,
    /// then (disaggregated) to the prefill worker expected to finish it first.
    fn admit_waiting(&mut self) {
        let serving = if self.colocated { Role::Colocated } else { Role::Decode };
        while let Some(&r) = self.waiting.front() {
            let q = self.reqs[r];
            let need = blocks_needed(q.prompt, q.output, 1, self.fleet.max_context, self.fleet.block_size as u32);
            let ids: Vec<usize> = (0..self.workers.len()).filter(|&w| self.workers[w].role == serving).collect();
            let total = self.fleet.kv_blocks as u32;
            let cands: Vec<DecodeCandidate> = ids
                .iter()
                .map(|&w| {
                    let k = &self.workers[w];
                    DecodeCandidate {
                        id: format!("{w:04}"),
                        state: WorkerState::Ready,
                        total_blocks: total,
                        free_blocks: total.saturating_sub(k.promised),
                        reserved_blocks: 0,
                        active_sequences: k.inflight,
                        router_inflight: k.inflight,
                        router_promised_blocks: k.promised,
                    }
                })
                .collect();
            let Some(&best) = rank_decode(&cands, need).first() else {
                if need > total {
                    // No worker could ever hold it: refused.
                    self.waiting.pop_front();
                    self.fail(r);
                    continue;
                }
                return;
            };
            self.waiting.pop_front();
            let d = ids[best];
            self.workers[d].promised += need;
            self.workers[d].inflight += 1;
            self.state[r].decode = d;
            self.state[r].reserved = need;
            if self.colocated {
                self.workers[d].active.push(Pre { r, done: 0 });
                self.kick(d);
                continue;
            }
            let pids: Vec<usize> = (0..self.workers.len()).filter(|&w| self.workers[w].role == Role::Prefill).collect();
            let rate = self.fleet.cost.prefill_rate(q.prompt) / self.fleet.calibration.prefill;
            let pc: Vec<PrefillCandidate> = pids
                .iter()
                .map(|&w| {
                    let k = &self.workers[w];
                    PrefillCandidate { id: format!("{w:04}"), state: WorkerState::Ready, inflight: k.queue.len() as u32 + k.active.len() as u32, outstanding_tokens: k.outstanding, reported_queue_tokens: 0, tokens_per_s: rate, disk_read_tokens_per_s: 0.0 }
                })
                .collect();
            let p = pids[pick_prefill(&pc, q.prompt).expect("a disaggregated split has a prefill worker")];
            self.state[r].prefill = Some(p);
            self.workers[p].outstanding += q.prompt as u64;
            self.workers[p].queue.push_back(r);
            self.kick(p);
        }
    }

    fn fail(&mut self, r: usize) {
        let s = &mut self.state[r];
        s.failed = true;
        s.done = true;
        s.last = self.now;
    }

    /// Start a step on `w` if it is idle and has work.
    fn kick(&mut self, w: usize) {
        if self.workers[w].step.is_some() {
            return;
        }
        let fleet = self.fleet;
        let (step, seconds) = match self.workers[w].role {
            Role::Prefill => {
                self.admit_prompts(w);
                let k = &self.workers[w];
                let prompts: Vec<PromptLeft> = k.active.iter().map(|a| PromptLeft::new(self.reqs[a.r].prompt - a.done)).collect();
                let plan = plan_prefill(fleet.max_batch_tokens, &prompts);
                if plan.is_empty() {
                    return;
                }
                let chunks: Vec<(usize, usize)> = plan.iter().map(|&(j, n)| (k.active[j].done, n)).collect();
                (Step::Prefill(plan), fleet.cost.step(0, 0, &chunks) * fleet.calibration.prefill)
            }
            role => {
                let policy = StepPolicy {
                    max_batch_tokens: fleet.max_batch_tokens,
                    accept_prompts: role == Role::Colocated,
                    chunk_tokens: if role == Role::Colocated { fleet.chunk_tokens } else { None },
                };
                let k = &mut self.workers[w];
                let prompts: Vec<PromptLeft> = k.active.iter().map(|a| PromptLeft::new(self.reqs[a.r].prompt - a.done)).collect();
                let plan = plan_step(&policy, k.running.len(), &prompts, &mut k.rotate);
                if plan.decodes.is_empty() && plan.prefills.is_empty() {
                    return;
                }
                // Tokens in each decoding sequence's cache before the step.
                let context: usize = plan.decodes.iter().map(|&i| self.reqs[k.running[i].r].prompt + k.running[i].count - 1).sum();
                let chunks: Vec<(usize, usize)> = plan.prefills.iter().map(|&(j, n)| (k.active[j].done, n)).collect();
                let factor = if role == Role::Colocated { fleet.calibration.colocated } else { fleet.calibration.decode };
                let seconds = fleet.cost.step(plan.decodes.len(), context, &chunks) * factor;
                (Step::Mixed(plan), seconds)
            }
        };
        self.workers[w].step = Some(step);
        self.at(self.now + seconds, Event::StepDone(w));
    }

    /// A prefill worker starts queued prompts while their blocks fit (FIFO).
    fn admit_prompts(&mut self, w: usize) {
        let total = self.fleet.kv_blocks;
        loop {
            let k = &self.workers[w];
            let Some(&r) = k.queue.front() else { return };
            let held: usize = k.leased + k.active.iter().map(|a| self.blocks(a.done)).sum::<usize>();
            let committed: usize = k.active.iter().map(|a| self.blocks(self.reqs[a.r].prompt) - self.blocks(a.done)).sum();
            let need = self.blocks(self.reqs[r].prompt);
            match admit_prompt(need, committed, total.saturating_sub(held), total) {
                Admit::Wait => return,
                Admit::Refuse => {
                    self.workers[w].queue.pop_front();
                    self.workers[w].outstanding -= self.reqs[r].prompt as u64;
                    let d = self.state[r].decode;
                    self.release(d, r);
                    self.fail(r);
                }
                Admit::Start => {
                    self.workers[w].queue.pop_front();
                    self.workers[w].active.push(Pre { r, done: 0 });
                }
            }
        }
    }

    fn step_done(&mut self, w: usize) {
        let Some(step) = self.workers[w].step.take() else { return };
        let now = self.now;
        match step {
            Step::Prefill(plan) => {
                for r in self.advance_prompts(w, &plan) {
                    let prompt = self.reqs[r].prompt;
                    let blocks = self.blocks(prompt);
                    let k = &mut self.workers[w];
                    k.outstanding -= prompt as u64;
                    k.leased += blocks;
                    // The first token goes to the client with prefill's answer.
                    self.first_token(r, now + self.fleet.kv.latency_s);
                    self.at(now + self.fleet.kv.seconds(prompt), Event::KvLanded(r));
                }
            }
            Step::Mixed(plan) => {
                let mut leaving = Vec::new();
                for &i in &plan.decodes {
                    let run = &mut self.workers[w].running[i];
                    run.count += 1;
                    let r = run.r;
                    let count = run.count;
                    self.state[r].count = count;
                    self.state[r].last = now;
                    if count >= self.reqs[r].output {
                        leaving.push(i);
                    }
                }
                leaving.sort_unstable_by(|a, b| b.cmp(a));
                for i in leaving {
                    let Run { r, .. } = self.workers[w].running.swap_remove(i);
                    self.finish(w, r);
                }
                for r in self.advance_prompts(w, &plan.prefills) {
                    self.first_token(r, now);
                    self.start(w, r);
                }
            }
        }
        self.kick(w);
    }

    /// Account `w`'s prompt chunks `(index, tokens)` as computed; the prompts they finish leave
    /// its active list, and their requests are returned (last index first).
    fn advance_prompts(&mut self, w: usize, chunks: &[(usize, usize)]) -> Vec<usize> {
        let mut finished = Vec::new();
        for &(j, n) in chunks {
            let a = &mut self.workers[w].active[j];
            a.done += n;
            if a.done == self.reqs[a.r].prompt {
                finished.push(j);
            }
        }
        finished.iter().rev().map(|&j| self.workers[w].active.remove(j).r).collect()
    }

    fn first_token(&mut self, r: usize, t: f64) {
        let s = &mut self.state[r];
        s.first = Some(t);
        s.last = t;
        s.count = 1;
    }

    /// A request whose first token is out joins `w`'s running batch (or is done already).
    fn start(&mut self, w: usize, r: usize) {
        if self.reqs[r].output <= 1 {
            self.finish(w, r);
        } else {
            self.workers[w].running.push(Run { r, count: 1 });
        }
    }

    fn kv_landed(&mut self, r: usize) {
        if let Some(p) = self.state[r].prefill {
            let blocks = self.blocks(self.reqs[r].prompt);
            let k = &mut self.workers[p];
            k.leased -= blocks;
            self.kick(p);
        }
        let d = self.state[r].decode;
        self.start(d, r);
        self.kick(d);
    }

    fn finish(&mut self, w: usize, r: usize) {
        self.state[r].done = true;
        self.release(w, r);
        self.admit_waiting();
    }

    fn release(&mut self, w: usize, r: usize) {
        let k = &mut self.workers[w];
        k.promised -= self.state[r].reserved;
        k.inflight -= 1;
    }
}

/// Latency percentiles, SLO attainment and throughput of one simulated (or measured) run.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Summary {
    pub requests: usize,
    pub failed: usize,
    pub ttft_p50_ms: f64,
    pub ttft_p90_ms: f64,
    pub ttft_p99_ms: f64,
    pub tpot_p50_ms: f64,
    pub tpot_p90_ms: f64,
    pub tpot_p99_ms: f64,
    pub attainment: f64,
    /// Output tokens per second over the run (first arrival to last token).
    pub tokens_per_s: f64,
}

impl Summary {
    pub fn of(samples: &[Sample], slo: &Slo) -> Summary {
        let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
        let ttft: Vec<f64> = ok.iter().map(|s| s.ttft_ms).collect();
        // Over every completed request, as `bench serve` counts them.
        let tpot: Vec<f64> = ok.iter().map(|s| s.tpot_ms).collect();
        let span_ms = ok.iter().map(|s| s.e2e_ms).fold(0.0, f64::max);
        let tokens: usize = ok.iter().map(|s| s.output_tokens).sum();
        Summary {
            requests: samples.len(),
            failed: samples.len() - ok.len(),
            ttft_p50_ms: percentile(&ttft, 50.0),
            ttft_p90_ms: percentile(&ttft, 90.0),
            ttft_p99_ms: percentile(&ttft, 99.0),
            tpot_p50_ms: percentile(&tpot, 50.0),
            tpot_p90_ms: percentile(&tpot, 90.0),
            tpot_p99_ms: percentile(&tpot, 99.0),
            attainment: attainment(samples, slo),
            tokens_per_s: if span_ms > 0.0 { tokens as f64 / (span_ms / 1e3) } else { 0.0 },
        }
    }
}

/// The highest rate (requests/s, within `tolerance` relative) at which `split` meets `slo` for at
/// least `target` of the requests `workload(rate)` generates; 0 when not even `lo` does, `hi` when
/// `hi` does. Attainment falls as the rate rises (more queueing), so a bisection finds it.
pub fn goodput(fleet: &Fleet, split: Split, workload: &dyn Fn(f64) -> Vec<SimRequest>, slo: &Slo, target: f64, lo: f64, hi: f64, tolerance: f64) -> f64 {
    let meets = |rate: f64| attainment(&simulate(fleet, split, &workload(rate)), slo) >= target;
    if !meets(lo) {
        return 0.0;
    }
    if meets(hi) {
        return hi;
    }
    let (mut ok, mut bad) = (lo, hi);
    while (bad - ok) > tolerance * ok {
        let mid = 0.5 * (ok + bad);
        if meets(mid) {
            ok = mid;
        } else {
            bad = mid;
        }
    }
    ok
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::Linear;

    /// Prefill 1 ms a token, decode 10 ms a step whatever the batch: easy arithmetic.
    fn fleet() -> Fleet {
        Fleet {
            cost: CostModel {
                prefill: Linear { a: 0.0, b: 1e-3, c: 0.0 },
                decode: Linear { a: 0.01, b: 0.0, c: 0.0 },
                decode_base: crate::profile::Knots::new(&[]),
                prefill_fit_error: 0.0,
                decode_fit_error: 0.0,
            },
            block_size: 16,
            kv_blocks: 1000,
            max_batch_tokens: 2048,
            max_context: 8192,
            chunk_tokens: None,
            kv: KvLink { bytes_per_token: 1000, bytes_per_s: 1e9, latency_s: 0.0 },
            calibration: Calibration::PROFILED,
        }
    }

    fn req(at: f64, prompt: usize, output: usize) -> SimRequest {
        SimRequest { at, prompt, output }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-6
    }

    #[test]
    fn one_request_alone_costs_what_the_model_says() {
        let f = fleet();
        let s = simulate(&f, Split::Disaggregated { prefill: 1, decode: 1 }, &[req(1.0, 100, 5)]);
        // Prefill 100 ms; the KV (100 kB at 1 GB/s) lands 0.1 ms later; four decode steps of 10 ms.
        assert!(s[0].ok);
        assert!(close(s[0].ttft_ms, 100.0), "{:?}", s[0]);
        assert!(close(s[0].tpot_ms, (0.1 + 40.0) / 4.0), "{:?}", s[0]);
        assert_eq!(s[0].output_tokens, 5);
        let c = simulate(&f, Split::Colocated { workers: 1 }, &[req(1.0, 100, 5)]);
        assert!(close(c[0].ttft_ms, 100.0) && close(c[0].tpot_ms, 10.0), "{:?}", c[0]);
    }

    #[test]
    fn a_calibration_prices_each_role_s_steps_by_its_own_factor() {
        // Prefill runs 1.5x the profile's time, decode 0.5x, colocated 2x.
        let f = Fleet { calibration: Calibration { prefill: 1.5, decode: 0.5, colocated: 2.0 }, ..fleet() };
        let s = simulate(&f, Split::Disaggregated { prefill: 1, decode: 1 }, &[req(1.0, 100, 5)]);
        assert!(close(s[0].ttft_ms, 150.0), "{:?}", s[0]);
        assert!(close(s[0].tpot_ms, (0.1 + 4.0 * 5.0) / 4.0), "{:?}", s[0]);
        let c = simulate(&f, Split::Colocated { workers: 1 }, &[req(1.0, 100, 5)]);
        assert!(close(c[0].ttft_ms, 200.0) && close(c[0].tpot_ms, 20.0), "{:?}", c[0]);
        assert!(Calibration::default().is_profiled() && !f.calibration.is_profiled());
    }

    #[test]
    fn prefill_first_stalls_colocated_decodes_and_disaggregation_does_not() {
        let f = fleet();
        // A long decode, then a 500-token prompt arriving while it runs.
        let reqs = [req(0.0, 10, 50), req(0.1, 500, 2)];
        let c = simulate(&f, Split::Colocated { workers: 1 }, &reqs);
        let d = simulate(&f, Split::Disaggregated { prefill: 1, decode: 1 }, &reqs);
        // Colocated: one of the first request's steps waits 500 ms for the prompt.
        assert!(c[0].tpot_ms > 10.0 + 400.0 / 49.0, "{c:?}");
        // Disaggregated: the decode worker never prefills (decode 10 ms a step whatever the batch).
        // (The first gap also carries the 10 µs KV transfer.)
        assert!((d[0].tpot_ms - 10.0).abs() < 1e-3, "{:?}", d[0]);
        // Chunked prefill bounds the stall to one chunk per step.
        let chunked = Fleet { chunk_tokens: Some(64), ..f };
        let k = simulate(&chunked, Split::Colocated { workers: 1 }, &reqs);
        assert!(k[0].tpot_ms < c[0].tpot_ms, "{:?} vs {:?}", k[0], c[0]);
    }

    #[test]
    fn prompts_queue_on_a_busy_prefill_worker_and_spread_over_two() {
        let f = fleet();
        let pair = [req(0.0, 1000, 2), req(0.0, 1000, 2)];
        let one = simulate(&f, Split::Disaggregated { prefill: 1, decode: 1 }, &pair);
        assert!(close(one[0].ttft_ms, 1000.0) && close(one[1].ttft_ms, 2000.0), "{one:?}");
        let two = simulate(&f, Split::Disaggregated { prefill: 2, decode: 1 }, &pair);
        assert!(close(two[0].ttft_ms, 1000.0) && close(two[1].ttft_ms, 1000.0), "{two:?}");
        // Prompts that queued behind a busy step go together in the next, up to the budget,
        // the last one chunked.
        let three = [req(0.0, 1000, 2), req(0.5, 500, 2), req(0.5, 500, 2)];
        let s = simulate(&f, Split::Disaggregated { prefill: 1, decode: 1 }, &three);
        assert!(close(s[1].ttft_ms, 1500.0) && close(s[2].ttft_ms, 1500.0), "{s:?}");
        let small = Fleet { max_batch_tokens: 600, ..f };
        let s = simulate(&small, Split::Disaggregated { prefill: 1, decode: 1 }, &three[1..]);
        // The first to arrive starts alone (the worker does not wait for company).
        assert!(close(s[0].ttft_ms, 500.0) && close(s[1].ttft_ms, 1000.0), "{s:?}");
    }

    #[test]
    fn requests_wait_for_decode_blocks_and_oversize_ones_fail() {
        // Room for one request at a time (10 + 20 tokens = 2 blocks of 16; 3 blocks in all).
        let f = Fleet { kv_blocks: 3, ..fleet() };
        let reqs = [req(0.0, 10, 20), req(0.0, 10, 20), req(0.0, 100, 2)];
        let s = simulate(&f, Split::Colocated { workers: 1 }, &reqs);
        assert!(s[0].ok && s[1].ok);
        assert!(s[1].ttft_ms >= s[0].e2e_ms, "the second waits for the first's blocks: {s:?}");
        assert!(!s[2].ok, "needs 7 blocks of 3");
        let d = simulate(&f, Split::Disaggregated { prefill: 1, decode: 1 }, &reqs);
        assert!(d[0].ok && d[1].ok && !d[2].ok, "{d:?}");
    }

    #[test]
    fn goodput_falls_where_the_slo_starts_to_miss() {
        let f = fleet();
        // 200-token prompts, 20 tokens out: a prefill worker serves 5 prompts a second.
        let workload = |rate: f64| crate::arrivals::poisson_arrivals(rate, 200, &mut crate::arrivals::uniforms(1)).into_iter().map(|at| req(at, 200, 20)).collect::<Vec<_>>();
        let slo = Slo { ttft_ms: 1000.0, tpot_ms: 50.0 };
        let one = goodput(&f, Split::Disaggregated { prefill: 1, decode: 1 }, &workload, &slo, 0.9, 0.1, 50.0, 0.02);
        let two = goodput(&f, Split::Disaggregated { prefill: 2, decode: 1 }, &workload, &slo, 0.9, 0.1, 50.0, 0.02);
        assert!(one > 2.0 && one < 5.0, "{one}");
        assert!(two > 1.6 * one && two < 10.0, "{two} vs {one}");
        let never = Slo { ttft_ms: 100.0, tpot_ms: 50.0 };
        assert_eq!(goodput(&f, Split::Disaggregated { prefill: 1, decode: 1 }, &workload, &never, 0.9, 0.1, 50.0, 0.02), 0.0);
    }

    #[test]
    fn splits_of_a_budget() {
        let s = Split::all(3);
        assert_eq!(s, vec![Split::Disaggregated { prefill: 1, decode: 2 }, Split::Disaggregated { prefill: 2, decode: 1 }, Split::Colocated { workers: 3 }]);
        assert!(s.iter().all(|x| x.workers() == 3));
        assert_eq!(Split::all(1), vec![Split::Colocated { workers: 1 }]);
        assert_eq!(s[0].to_string(), "1P:2D");
    }

    #[test]
    fn summaries_count_failures_as_misses() {
        let f = Fleet { kv_blocks: 3, ..fleet() };
        let s = simulate(&f, Split::Colocated { workers: 1 }, &[req(0.0, 10, 5), req(0.0, 100, 2)]);
        let sum = Summary::of(&s, &Slo { ttft_ms: 1e6, tpot_ms: 1e6 });
        assert_eq!((sum.requests, sum.failed), (2, 1));
        assert_eq!(sum.attainment, 0.5);
        assert!(close(sum.tpot_p50_ms, 10.0));
    }
}
