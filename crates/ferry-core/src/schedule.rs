//! What goes into an engine step, as pure functions over plain numbers: the workers call them
//! between steps, and `ferry plan`'s simulator ([`crate::sim`]) calls the same ones, so what it
//! predicts is what the workers decide, not a re-implementation.
//!
//! - [`plan_step`]: a decode or colocated worker's step (Orca's continuous batching, OSDI '22):
//!   which running sequences decode and which prompt chunks ride along, under a token budget,
//!   either *prefill first* (vLLM's classic scheduler: a step with prompts runs only them) or
//!   *chunked prefill* (Sarathi-Serve, arXiv:2403.02310: every step carries all decodes plus
//!   prompt chunks filling the rest of the budget).
//! - [`plan_prefill`]: a prefill worker's step: its active prompts' next chunks, first come first
//!   served, up to the budget.
//! - [`admit_prompt`]: whether a prefill worker starts the next queued prompt now, waits for
//!   blocks to come back, or refuses it (it could never fit).

/// A prompt being prefilled, as the step planner sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PromptLeft {
    /// Tokens not yet computed.
    pub left: usize,
    /// The most tokens one chunk of it may take (`usize::MAX`: no limit of its own).
    pub cap: usize,
}

impl PromptLeft {
    pub fn new(left: usize) -> Self {
        PromptLeft { left, cap: usize::MAX }
    }
}

/// How a decode or colocated worker fills its steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepPolicy {
    /// The engine's most tokens in one forward pass.
    pub max_batch_tokens: usize,
    /// Takes prompts of its own (a colocated worker). A decode worker's prompts are short suffixes
    /// after a cached prefix: they always ride along with the decodes.
    pub accept_prompts: bool,
    /// Chunked prefill with this token budget per step; None: prefill first, whole prompts.
    pub chunk_tokens: Option<usize>,
}

/// The rows of one step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Indices of the running sequences that decode one token.
    pub decodes: Vec<usize>,
    /// (index of the prompt, tokens of it computed this step), in queue order.
    pub prefills: Vec<(usize, usize)>,
}

impl StepPlan {
    /// Tokens the step computes (its batch size in tokens).
    pub fn tokens(&self) -> usize {
        self.decodes.len() + self.prefills.iter().map(|p| p.1).sum::<usize>()
    }
}

/// The next step of a decode or colocated worker with `running` sequences decoding and
/// `prompts` being prefilled. `rotate` carries, across steps, where the decode rotation stands
/// when there are more running sequences than the budget holds (each then waits its turn).
pub fn plan_step(policy: &StepPolicy, running: usize, prompts: &[PromptLeft], rotate: &mut usize) -> StepPlan {
    let cap = policy.max_batch_tokens.max(1);
    let prefill_first = policy.accept_prompts && policy.chunk_tokens.is_none() && !prompts.is_empty();
    let budget = policy.chunk_tokens.unwrap_or(cap).min(cap).max(1);
    let mut plan = StepPlan::default();
    let mut left = budget;
    if !prefill_first && running > 0 {
        let n = running.min(left);
        let start = if n < running { *rotate % running } else { 0 };
        *rotate = rotate.wrapping_add(n);
        plan.decodes.extend((0..n).map(|k| (start + k) % running));
        left -= n;
    }
    plan.prefills = fill_chunks(prompts, left);
    plan
}

/// A prefill worker's next step over its active prompts (in the order they started).
pub fn plan_prefill(max_batch_tokens: usize, prompts: &[PromptLeft]) -> Vec<(usize, usize)> {
    fill_chunks(prompts, max_batch_tokens.max(1))
}

/// Prompts' next chunks, in order, until `budget` tokens are spent.
fn fill_chunks(prompts: &[PromptLeft], mut budget: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    for (j, p) in prompts.iter().enumerate() {
        if budget == 0 {
            break;
        }
        let n = p.left.min(budget).min(p.cap.max(1));
        if n == 0 {
            continue;
        }
        out.push((j, n));
        budget -= n;
    }
    out
}

/// What a prefill worker does with the prompt at the front of its queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Start it: its blocks fit beside what the active prompts still need.
    Start,
    /// Leave it queued (and everything behind it: the queue is FIFO) until blocks come back.
    Wait,
    /// It needs more blocks than the worker has at all: refuse it.
    Refuse,
}

/// Whether a prompt needing `need` KV blocks starts now, when the prompts already started still
/// need `committed` more blocks than they hold, `free` blocks can be allocated, and the worker has
/// `total` blocks in all.
pub fn admit_prompt(need: usize, committed: usize, free: usize, total: usize) -> Admit {
    if need > total {
        Admit::Refuse
    } else if committed + need > free {
        Admit::Wait
    } else {
        Admit::Start
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompts(lefts: &[usize]) -> Vec<PromptLeft> {
        lefts.iter().map(|&l| PromptLeft::new(l)).collect()
    }

    #[test]
    fn steps_table() {
        let decode = StepPolicy { max_batch_tokens: 8, accept_prompts: false, chunk_tokens: None };
        let first = StepPolicy { accept_prompts: true, ..decode };
        let chunked = StepPolicy { chunk_tokens: Some(6), ..first };
        // (policy, running, prompts left, decodes, prefills)
        let cases: Vec<(StepPolicy, usize, Vec<usize>, Vec<usize>, Vec<(usize, usize)>)> = vec![
            // A decode worker: every running sequence, and suffix prompts in what is left.
            (decode, 3, vec![], vec![0, 1, 2], vec![]),
            (decode, 3, vec![4, 4], vec![0, 1, 2], vec![(0, 4), (1, 1)]),
            // Prefill first: a step with prompts runs only them, up to the engine's budget.
            (first, 3, vec![5, 5], vec![], vec![(0, 5), (1, 3)]),
            (first, 3, vec![], vec![0, 1, 2], vec![]),
            // Chunked: all decodes plus chunks filling the chunk budget.
            (chunked, 2, vec![10], vec![0, 1], vec![(0, 4)]),
            (chunked, 6, vec![10], vec![0, 1, 2, 3, 4, 5], vec![]),
            (chunked, 0, vec![3, 10], vec![], vec![(0, 3), (1, 3)]),
            // A chunk budget above the engine's is capped by it.
            (StepPolicy { chunk_tokens: Some(100), ..first }, 1, vec![50], vec![0], vec![(0, 7)]),
        ];
        for (k, (policy, running, lefts, decodes, prefills)) in cases.into_iter().enumerate() {
            let plan = plan_step(&policy, running, &prompts(&lefts), &mut 0);
            assert_eq!(plan.decodes, decodes, "case {k}");
            assert_eq!(plan.prefills, prefills, "case {k}");
            assert!(plan.tokens() <= policy.chunk_tokens.unwrap_or(8).min(8), "case {k}");
        }
    }

    #[test]
    fn more_running_than_the_budget_take_turns() {
        let policy = StepPolicy { max_batch_tokens: 3, accept_prompts: false, chunk_tokens: None };
        let mut rotate = 0;
        let steps: Vec<Vec<usize>> = (0..3).map(|_| plan_step(&policy, 5, &[], &mut rotate).decodes).collect();
        assert_eq!(steps, vec![vec![0, 1, 2], vec![3, 4, 0], vec![1, 2, 3]]);
        // Everyone fits: no rotation, and the counter does not matter.
        assert_eq!(plan_step(&policy, 2, &[], &mut rotate).decodes, vec![0, 1]);
    }

    #[test]
    fn a_chunk_cap_limits_one_prompt_not_the_step() {
        let capped = [PromptLeft { left: 10, cap: 2 }, PromptLeft::new(10)];
        assert_eq!(plan_prefill(8, &capped), vec![(0, 2), (1, 6)]);
        assert_eq!(plan_prefill(8, &prompts(&[3, 0, 9])), vec![(0, 3), (2, 5)]);
        assert_eq!(plan_prefill(0, &prompts(&[3])), vec![(0, 1)]);
        assert!(plan_prefill(8, &[]).is_empty());
    }

    #[test]
    fn admission_table() {
        // (need, committed, free, total, decision)
        for (need, committed, free, total, want) in [
            (4, 0, 10, 10, Admit::Start),
            (4, 6, 10, 10, Admit::Start),
            (4, 7, 10, 10, Admit::Wait),
            (11, 0, 10, 10, Admit::Refuse),
            (10, 0, 3, 10, Admit::Wait),
            (0, 0, 0, 0, Admit::Start),
        ] {
            assert_eq!(admit_prompt(need, committed, free, total), want, "need {need} committed {committed} free {free} total {total}");
        }
    }
}
