//! What each prefill worker would take over a prompt: its queue, and the prompt less the prefix
//! it holds in its pool or on its disk ([`ferry_core::routing::PrefillCandidate::expected_seconds_for`]).
//! The prefill step picks by it; the admission step sends the pick's time to the decode worker,
//! which weighs it against computing a short suffix itself ([`ferry_core::cache_policy::plan_turn`]).

use ferry_core::WorkerState;
use ferry_core::kv_index::Overlap;
use ferry_core::routing::{PrefillCandidate, PrefillWork, pick_prefill_for};

use crate::config::PrefixRouting;
use crate::pipeline::request::Job;
use crate::state::Shared;
use crate::workers::load::PrefixChains;

/// KV-aware: the prompt's block chain, to find each worker's cached prefix of it (empty when
/// routing by load alone).
pub fn chain_for(shared: &Shared, job: &Job, prompt: &[u32], bs: usize) -> PrefixChains {
    match shared.cfg.prefix_routing {
        PrefixRouting::KvAware => shared.registry.prefix_chain(&job.cache_salt, prompt, bs),
        PrefixRouting::LoadOnly => Default::default(),
    }
}

/// The prefill workers, each with its cached run of the prompt, in its pool or on its disk: pool
/// blocks are attached, disk blocks loaded (priced at the worker's read rate), the rest computed.
pub(super) struct Priced {
    pub cands: Vec<PrefillCandidate>,
    pub held: Vec<Overlap>,
}

/// [`Priced`] now; the workers `skip` names are marked dead (not picked).
pub(super) fn priced(shared: &Shared, chain: &PrefixChains, prompt_len: usize, bs: usize, skip: impl Fn(&str) -> bool) -> Priced {
    let reg = &shared.registry;
    let mut cands = reg.prefill_candidates();
    for c in cands.iter_mut().filter(|c| skip(&c.id)) {
        c.state = WorkerState::Dead;
    }
    // At least the last token is computed (its logits give the first token).
    let usable = prompt_len.saturating_sub(1) / bs.max(1);
    let held = cands.iter().map(|c| if chain.is_empty() { Overlap::default() } else { reg.prefix_held(&c.id, chain, usable) }).collect();
    Priced { cands, held }
}

pub(super) fn work_at(prompt_len: usize, held: Overlap, bs: usize) -> PrefillWork {
    PrefillWork { compute: prompt_len - held.total() * bs, disk: held.disk * bs }
}

/// The seconds the prefill worker [`super::prefill::prefill`] would pick is expected to take over a prompt of
/// `prompt_len` tokens whose block chain is `chain` (its queue, the prompt less its cached prefix); None until the workers' rates are measured. The
/// decode worker weighs it against computing the prompt's suffix itself
/// ([`ferry_core::cache_policy::plan_turn`]).
pub fn expected_prefill_seconds(shared: &Shared, chain: &PrefixChains, prompt_len: usize, avoid: &[String], bs: usize) -> Option<f64> {
    let Priced { cands, held } = priced(shared, chain, prompt_len, bs, |id| avoid.iter().any(|a| a == id));
    let work = |i: usize| work_at(prompt_len, held[i], bs);
    pick_prefill_for(&cands, &work).and_then(|i| cands[i].expected_seconds_for(work(i)))
}
