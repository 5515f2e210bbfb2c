//! The proposers of speculative decoding without a draft model: guesses of the next tokens of a
//! sequence, drawn from text already seen, that a decode worker verifies in one forward pass
//! (keeping those the sampler would have drawn anyway). Verification lives with the sampler; this
//! module only proposes, and a wrong guess costs compute, never correctness.
//!
//! - [`ngram_propose`]: prompt lookup (vLLM's `ngram` proposer; Saxena, "Prompt Lookup Decoding",
//!   2023): continue the sequence the way its own latest suffix continued earlier in it. Good at
//!   summaries, code edits and quoting, where the output copies the prompt.
//! - [`SuffixIndex`]: a worker-wide index of earlier prompts and outputs (SuffixDecoding, Oliaro et
//!   al., arXiv:2411.04975, simplified from a suffix tree to a variable-order frequency model over
//!   hashed contexts): good at agentic and templated traffic, where requests repeat each other.
//!
//! Both run every decode step for every sequence, so neither allocates beyond the caller's `out`.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::str::FromStr;

/// Which proposer a worker uses: `--speculate off|ngram|suffix`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SpecMode {
    /// No speculation: one token per sequence per step.
    #[default]
    Off,
    /// [`ngram_propose`] over the sequence's own history.
    Ngram,
    /// [`SuffixIndex::propose`] over the worker's earlier requests.
    Suffix,
}

impl SpecMode {
    /// The name the flag uses.
    pub fn name(self) -> &'static str {
        match self {
            SpecMode::Off => "off",
            SpecMode::Ngram => "ngram",
            SpecMode::Suffix => "suffix",
        }
    }
}

impl fmt::Display for SpecMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SpecMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "off" => Ok(SpecMode::Off),
            "ngram" => Ok(SpecMode::Ngram),
            "suffix" => Ok(SpecMode::Suffix),
            _ => Err(format!("unknown speculation mode {s:?}: expected off, ngram or suffix")),
        }
    }
}

/// Prompt lookup (vLLM's `ngram`, Saxena's prompt lookup decoding): find the longest suffix of
/// `history` of length in `min_match..=max_match` that also occurs earlier in `history`, take its
/// MOST RECENT earlier occurrence, and append to `out` up to `k` tokens that followed it (fewer if
/// the history ends first). Appends nothing when there is no match. `out` is not cleared.
///
/// Longest first because a longer match is more likely to continue the same way; most recent
/// because the nearby text is the likeliest to be copied next. The continuation may run into the
/// suffix itself (in "a b a b a", the suffix "a b a" recurs at the start and is followed by
/// "b a"): a repeating pattern is then proposed to continue, which is what it usually does.
///
/// One backward scan over `history`: each position whose preceding `min_match` tokens equal the
/// suffix's is extended backwards up to `max_match`; the scan ends early at a match of
/// `max_match`, which nothing older can beat. O(len × max_match) at worst, no allocation. A
/// `min_match` of 0 counts as 1 (an empty match says nothing).
pub fn ngram_propose(history: &[u32], min_match: usize, max_match: usize, k: usize, out: &mut Vec<u32>) {
    let n = history.len();
    let min_match = min_match.max(1);
    if k == 0 || max_match < min_match || n <= min_match {
        return;
    }
    let last = history[n - 1];
    // (match length, end of the occurrence): the best so far.
    let mut best: Option<(usize, usize)> = None;
    // `end` is one past an earlier occurrence's last token; it must leave the suffix's own last
    // token after it, so the occurrence has at least one follower.
    for end in (min_match..n).rev() {
        if history[end - 1] != last {
            continue;
        }
        // Longest common suffix of history[..end] and history[..n], capped at max_match.
        let cap = max_match.min(end);
        let mut len = 1;
        while len < cap && history[end - 1 - len] == history[n - 1 - len] {
            len += 1;
        }
        if len >= min_match && best.is_none_or(|(b, _)| len > b) {
            best = Some((len, end));
            if len == max_match {
                break;
            }
        }
    }
    if let Some((_, end)) = best {
        out.extend_from_slice(&history[end..n.min(end + k)]);
    }
}

/// One token that followed a context: how often, and when last (the index's clock).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Follower {
    token: u32,
    count: u32,
    stamp: u64,
}

/// The tokens that followed one context. A `Vec`, not a map: most contexts have a handful.
#[derive(Clone, Debug, Default)]
struct Followers {
    total: u32,
    next: Vec<Follower>,
}

/// The context keys are already mixed 64-bit hashes ([`mix`]): hashing them again would only
/// cost time.
#[derive(Default)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type ContextMap = HashMap<u64, Followers, BuildHasherDefault<PassThrough>>;

/// The hash of a context grows one token at a time from its end backwards: `mix(h, t)` is the
/// hash of `t` followed by the window `h` hashed. So the hashes of the suffixes of order 1, 2, ..
/// of a sequence come out of one backward walk, with no buffer. SplitMix64's finalizer (Steele et
/// al.) as the mixer: every input bit reaches every output bit, which the pass-through map needs.
/// Two contexts that collide share counts; that only makes a guess worse, never an output wrong.
fn mix(h: u64, t: u32) -> u64 {
    let mut z = (h ^ u64::from(t)).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The hash of the empty context, where every walk starts.
const EMPTY: u64 = 0x243F_6A88_85A3_08D3;

/// A request's document in the index (see [`SuffixIndex::begin`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DocId(u64);

/// A worker-wide suffix index (SuffixDecoding, arXiv:2411.04975, simplified to a variable-order
/// frequency model): for every context of 1..=max_order tokens seen in earlier prompts and outputs,
/// how often each next token followed it. Bounded memory: documents are kept in arrival order and
/// the oldest are evicted (their counts subtracted) once more than `max_tokens` tokens are indexed.
///
/// The paper keeps a suffix tree and scores whole speculation trees; counts per hashed context
/// give the same greedy path for a fraction of the code, and eviction is exact because each
/// document's tokens are kept and its counts subtracted as they were added. Memory is then at
/// most `max_tokens` tokens and `max_tokens × max_order` context entries.
pub struct SuffixIndex {
    max_tokens: usize,
    max_order: usize,
    contexts: ContextMap,
    /// Held documents, oldest first; their ids run without gaps from `first_id`.
    docs: VecDeque<Vec<u32>>,
    first_id: u64,
    /// Tokens counted, over all held documents.
    tokens: usize,
    /// Tokens ever counted: the recency stamp of a follower.
    clock: u64,
}

impl SuffixIndex {
    /// An empty index that holds at most `max_tokens` tokens and counts contexts of up to
    /// `max_order` tokens (a `max_order` of 0 counts as 1).
    pub fn new(max_tokens: usize, max_order: usize) -> Self {
        SuffixIndex {
            max_tokens,
            max_order: max_order.max(1),
            contexts: ContextMap::default(),
            docs: VecDeque::new(),
            first_id: 0,
            tokens: 0,
            clock: 0,
        }
    }

    /// A new document (one request's choice: its prompt, then its output as it grows).
    pub fn begin(&mut self) -> DocId {
        self.docs.push_back(Vec::new());
        DocId(self.first_id + self.docs.len() as u64 - 1)
    }

    /// Append tokens to a document, counting each new token under the contexts of 1..=max_order
    /// tokens that precede it in that document. A document that was evicted ignores this.
    ///
    /// Room is made first by evicting the oldest documents, this one included when it is the
    /// oldest of several (its later calls are then ignored). A document alone past `max_tokens`
    /// keeps its first `max_tokens` tokens and drops the rest.
    pub fn extend(&mut self, doc: DocId, tokens: &[u32]) {
        for &t in tokens {
            if !self.make_room(doc) {
                return;
            }
            let Some(slot) = self.slot(doc) else { return };
            let stamp = self.clock;
            self.clock += 1;
            let d = &mut self.docs[slot];
            let mut h = EMPTY;
            for &c in d.iter().rev().take(self.max_order) {
                h = mix(h, c);
                let f = self.contexts.entry(h).or_default();
                f.total += 1;
                match f.next.iter_mut().find(|x| x.token == t) {
                    Some(x) => {
                        x.count += 1;
                        x.stamp = stamp;
                    }
                    None => f.next.push(Follower { token: t, count: 1, stamp }),
                }
            }
            d.push(t);
            self.tokens += 1;
        }
    }

    /// Evict oldest documents until one more token fits. False when `doc` cannot take it: it was
    /// evicted (now or before), or it is alone and full.
    fn make_room(&mut self, doc: DocId) -> bool {
        while self.tokens >= self.max_tokens {
            match self.slot(doc) {
                None => return false,
                Some(0) if self.docs.len() == 1 => return false,
                Some(_) => self.evict_oldest(),
            }
        }
        self.slot(doc).is_some()
    }

    /// Where `doc` is in `docs`, if it is still held.
    fn slot(&self, doc: DocId) -> Option<usize> {
        let i = usize::try_from(doc.0.checked_sub(self.first_id)?).ok()?;
        (i < self.docs.len()).then_some(i)
    }

    /// Drop the oldest document, subtracting exactly the counts its tokens added, and the
    /// contexts nothing else holds.
    fn evict_oldest(&mut self) {
        let Some(d) = self.docs.pop_front() else { return };
        self.first_id += 1;
        self.tokens -= d.len();
        for p in 0..d.len() {
            let t = d[p];
            let mut h = EMPTY;
            for &c in d[..p].iter().rev().take(self.max_order) {
                h = mix(h, c);
                let Some(f) = self.contexts.get_mut(&h) else { continue };
                if let Some(i) = f.next.iter().position(|x| x.token == t) {
                    f.total -= 1;
                    f.next[i].count -= 1;
                    if f.next[i].count == 0 {
                        f.next.swap_remove(i);
                    }
                }
                if f.total == 0 {
                    self.contexts.remove(&h);
                }
            }
        }
    }

    /// Propose up to `k` tokens to follow `context` (the sequence so far), appended to `out`:
    /// greedily, each next token is the most frequent follower of the longest suffix of
    /// (context + proposed so far) that has been seen, of at least `min_order` tokens (ties: the
    /// token seen most recently); stop when no such suffix has been seen, or when the product of
    /// the chosen tokens' empirical probabilities (count / total of that context) falls below
    /// `min_prob`.
    ///
    /// The longest suffix seen is the most specific evidence; the product of probabilities is the
    /// chance (under the counts) that the whole guess survives verification, so a guess stops
    /// where the next token would more likely waste its slot. A context is counted only with all
    /// its shorter suffixes, so the walk stops at the first order not seen: at most `max_order`
    /// lookups per token, and nothing allocated beyond `out`. A `min_order` of 0 counts as 1.
    pub fn propose(&self, context: &[u32], min_order: usize, min_prob: f32, k: usize, out: &mut Vec<u32>) {
        let start = out.len();
        let min_order = min_order.max(1);
        let mut prob = 1.0f32;
        for _ in 0..k {
            let proposed = &out[start..];
            let mut h = EMPTY;
            let mut best: Option<&Followers> = None;
            let mut order = 0;
            for &c in proposed.iter().rev().chain(context.iter().rev()).take(self.max_order) {
                h = mix(h, c);
                match self.contexts.get(&h) {
                    Some(f) => {
                        best = Some(f);
                        order += 1;
                    }
                    None => break,
                }
            }
            let Some(f) = best.filter(|_| order >= min_order) else { return };
            let Some(next) = f.next.iter().max_by_key(|x| (x.count, x.stamp)) else { return };
            prob *= next.count as f32 / f.total as f32;
            if prob < min_prob {
                return;
            }
            out.push(next.token);
        }
    }

    /// Tokens indexed now (<= max_tokens once evictions catch up).
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Documents held, evicted ones not counted.
    pub fn documents(&self) -> usize {
        self.docs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arrivals::uniforms;

    fn ngram(history: &[u32], min_match: usize, max_match: usize, k: usize) -> Vec<u32> {
        let mut out = Vec::new();
        ngram_propose(history, min_match, max_match, k, &mut out);
        out
    }

    /// The definition, spelled out: every length from the longest down, every earlier start from
    /// the most recent back.
    fn ngram_oracle(h: &[u32], min_match: usize, max_match: usize, k: usize) -> Vec<u32> {
        let n = h.len();
        for len in (min_match.max(1)..=max_match).rev() {
            if len >= n {
                continue;
            }
            let suffix = &h[n - len..];
            for start in (0..n - len).rev() {
                if &h[start..start + len] == suffix {
                    return h[start + len..n.min(start + len + k)].to_vec();
                }
            }
        }
        Vec::new()
    }

    #[test]
    fn spec_mode_parses_and_prints_its_names() {
        for m in [SpecMode::Off, SpecMode::Ngram, SpecMode::Suffix] {
            assert_eq!(m.to_string().parse::<SpecMode>(), Ok(m));
        }
        assert_eq!("NGRAM".parse::<SpecMode>(), Ok(SpecMode::Ngram));
        assert_eq!(SpecMode::default(), SpecMode::Off);
        let e = "eagle".parse::<SpecMode>().unwrap_err();
        assert!(e.contains("eagle") && e.contains("off, ngram or suffix"), "{e}");
    }

    #[test]
    fn ngram_match_in_the_middle_proposes_what_followed() {
        let h = [1, 2, 3, 4, 5, 6, 7, 8, 3, 4];
        assert_eq!(ngram(&h, 2, 4, 3), [5, 6, 7]);
        // The history's end bounds the continuation.
        let h = [9, 1, 2, 3, 1, 2];
        assert_eq!(ngram(&h, 2, 4, 10), [3, 1, 2]);
    }

    #[test]
    fn ngram_longest_match_beats_a_shorter_more_recent_one() {
        // Suffix [7, 8, 9]: occurs at the start (then 1); [8, 9] alone recurs later (then 2).
        let h = [7, 8, 9, 1, 0, 8, 9, 2, 0, 7, 8, 9];
        assert_eq!(ngram(&h, 1, 3, 1), [1]);
        // Capped at 2, the lengths tie and the most recent wins.
        assert_eq!(ngram(&h, 1, 2, 1), [2]);
    }

    #[test]
    fn ngram_ties_go_to_the_most_recent_occurrence() {
        let h = [5, 6, 1, 0, 5, 6, 2, 0, 5, 6, 3, 0, 5, 6];
        assert_eq!(ngram(&h, 2, 2, 2), [3, 0]);
    }

    #[test]
    fn ngram_continuation_may_overlap_the_suffix() {
        let h = [1, 2, 1, 2, 1, 2];
        // Capped at 3: [2, 1, 2] recurs at 1..4, and its followers are the suffix's own tokens.
        assert_eq!(ngram(&h, 1, 3, 4), [1, 2]);
        // Uncapped: the longest earlier occurrence is [1, 2, 1, 2] at 0..4, overlapping the suffix.
        assert_eq!(ngram(&h, 1, 8, 4), [1, 2]);
        let h = [4, 4, 4, 4];
        assert_eq!(ngram(&h, 1, 8, 4), [4]);
    }

    #[test]
    fn ngram_without_a_match_appends_nothing_and_keeps_out() {
        let mut out = vec![42];
        ngram_propose(&[1, 2, 3, 4], 1, 3, 5, &mut out);
        assert_eq!(out, [42]);
        ngram_propose(&[1, 2, 1], 1, 3, 5, &mut out);
        assert_eq!(out, [42, 2, 1]);
    }

    #[test]
    fn ngram_k_limits_the_proposal() {
        let h = [1, 2, 3, 4, 5, 6, 1, 2];
        assert_eq!(ngram(&h, 2, 2, 0), Vec::<u32>::new());
        assert_eq!(ngram(&h, 2, 2, 1), [3]);
        assert_eq!(ngram(&h, 2, 2, 3), [3, 4, 5]);
    }

    #[test]
    fn ngram_history_shorter_than_min_match_proposes_nothing() {
        assert!(ngram(&[], 1, 3, 4).is_empty());
        assert!(ngram(&[1], 1, 3, 4).is_empty());
        assert!(ngram(&[1, 1], 3, 3, 4).is_empty());
        assert!(ngram(&[1, 1, 1], 3, 3, 4).is_empty());
        assert_eq!(ngram(&[1, 1, 1, 1], 3, 3, 4), [1]);
    }

    #[test]
    fn ngram_respects_min_and_max_match() {
        // Only a 1-token match ([3] then 9) exists.
        let h = [3, 9, 0, 3];
        assert_eq!(ngram(&h, 1, 4, 1), [9]);
        assert!(ngram(&h, 2, 4, 1).is_empty());
        // max below min: nothing.
        assert!(ngram(&h, 2, 1, 1).is_empty());
        // A 3-token match exists but max_match 1 picks the most recent 1-token match.
        let h = [1, 2, 3, 7, 3, 8, 1, 2, 3];
        assert_eq!(ngram(&h, 1, 3, 1), [7]);
        assert_eq!(ngram(&h, 1, 1, 1), [8]);
    }

    #[test]
    fn ngram_agrees_with_the_definition_on_random_histories() {
        let mut u = uniforms(7);
        for case in 0..5000 {
            let alphabet = 2 + (u() * 4.0) as u32;
            let len = (u() * 40.0) as usize;
            let h: Vec<u32> = (0..len).map(|_| (u() * alphabet as f64) as u32).collect();
            let min_match = (u() * 4.0) as usize;
            let max_match = (u() * 7.0) as usize;
            let k = (u() * 6.0) as usize;
            assert_eq!(
                ngram(&h, min_match, max_match, k),
                ngram_oracle(&h, min_match, max_match, k),
                "case {case}: {h:?} min {min_match} max {max_match} k {k}"
            );
        }
    }

    fn index_of(docs: &[&[u32]], max_tokens: usize, max_order: usize) -> SuffixIndex {
        let mut ix = SuffixIndex::new(max_tokens, max_order);
        for d in docs {
            let id = ix.begin();
            ix.extend(id, d);
        }
        ix
    }

    fn suffix(ix: &SuffixIndex, context: &[u32], min_order: usize, min_prob: f32, k: usize) -> Vec<u32> {
        let mut out = Vec::new();
        ix.propose(context, min_order, min_prob, k, &mut out);
        out
    }

    /// One context's counts, stamps aside: (context hash, total, (token, count) sorted).
    type Counts = (u64, u32, Vec<(u32, u32)>);

    /// What the index's counts say, sorted by context.
    fn counts(ix: &SuffixIndex) -> Vec<Counts> {
        let mut v: Vec<_> = ix
            .contexts
            .iter()
            .map(|(&h, f)| {
                let mut next: Vec<_> = f.next.iter().map(|x| (x.token, x.count)).collect();
                next.sort_unstable();
                (h, f.total, next)
            })
            .collect();
        v.sort_unstable();
        v
    }

    #[test]
    fn suffix_proposes_a_documents_continuation() {
        let ix = index_of(&[&[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], 1000, 3);
        assert_eq!(suffix(&ix, &[7, 3, 4, 5], 1, 0.0, 8), [6, 7, 8, 9, 10]);
        assert_eq!(suffix(&ix, &[7, 3, 4, 5], 1, 0.0, 2), [6, 7]);
        // The longest suffix seen is [5]: order 2 required, nothing.
        assert!(suffix(&ix, &[3, 5], 2, 0.0, 4).is_empty());
        assert_eq!(suffix(&ix, &[3, 5], 1, 0.0, 1), [6]);
        // Nothing seen, or nothing asked.
        assert!(suffix(&ix, &[99], 1, 0.0, 4).is_empty());
        assert!(suffix(&ix, &[3, 4, 5], 1, 0.0, 0).is_empty());
        let mut out = vec![42];
        ix.propose(&[3, 4], 1, 0.0, 1, &mut out);
        assert_eq!(out, [42, 5]);
    }

    #[test]
    fn suffix_longest_context_decides() {
        // After [2] alone, 9 is the most frequent; after [1, 2], 3.
        let ix = index_of(&[&[1, 2, 3], &[5, 2, 9], &[6, 2, 9]], 1000, 2);
        assert_eq!(suffix(&ix, &[1, 2], 1, 0.0, 1), [3]);
        assert_eq!(suffix(&ix, &[7, 2], 1, 0.0, 1), [9]);
    }

    #[test]
    fn suffix_frequency_beats_recency_and_recency_breaks_ties() {
        let ix = index_of(&[&[1, 2, 3], &[1, 2, 3], &[1, 2, 3], &[1, 2, 9]], 1000, 2);
        assert_eq!(suffix(&ix, &[1, 2], 1, 0.0, 1), [3]);
        let ix = index_of(&[&[1, 2, 3], &[1, 2, 9]], 1000, 2);
        assert_eq!(suffix(&ix, &[1, 2], 1, 0.0, 1), [9]);
        let ix = index_of(&[&[1, 2, 9], &[1, 2, 3]], 1000, 2);
        assert_eq!(suffix(&ix, &[1, 2], 1, 0.0, 1), [3]);
    }

    #[test]
    fn suffix_min_prob_cuts_the_proposal() {
        // After 1: 2 or 3 (3 the more recent), p = 0.5; after 3: 4 or 5, p = 0.5; after 5: nothing.
        let ix = index_of(&[&[1, 2], &[1, 3], &[3, 4], &[3, 5]], 1000, 1);
        assert_eq!(suffix(&ix, &[1], 1, 0.0, 8), [3, 5]);
        assert_eq!(suffix(&ix, &[1], 1, 0.25, 8), [3, 5]);
        assert_eq!(suffix(&ix, &[1], 1, 0.3, 8), [3]);
        assert!(suffix(&ix, &[1], 1, 0.6, 8).is_empty());
    }

    #[test]
    fn suffix_eviction_bounds_tokens_and_forgets_exactly() {
        let mut ix = SuffixIndex::new(20, 3);
        for i in 0..10u32 {
            let id = ix.begin();
            ix.extend(id, &[100 + i, 1, 2, 200 + i, 3]);
        }
        assert!(ix.tokens() <= 20, "{}", ix.tokens());
        assert_eq!((ix.tokens(), ix.documents()), (20, 4));
        // The first document's continuation is gone; the last one's is there.
        assert!(suffix(&ix, &[100], 1, 0.0, 4).is_empty());
        assert!(suffix(&ix, &[200], 1, 0.0, 4).is_empty());
        assert_eq!(suffix(&ix, &[109], 1, 0.0, 4), [1, 2, 209, 3]);
        // No leftovers: the counts are those of a fresh index of the survivors.
        let survivors: Vec<&[u32]> = ix.docs.iter().map(Vec::as_slice).collect();
        let fresh = index_of(&survivors, 20, 3);
        assert_eq!(ix.contexts.len(), fresh.contexts.len());
        assert_eq!(counts(&ix), counts(&fresh));
    }

    #[test]
    fn suffix_eviction_matches_a_fresh_index_on_random_traffic() {
        let mut u = uniforms(11);
        for case in 0..200 {
            let max_tokens = 1 + (u() * 60.0) as usize;
            let max_order = 1 + (u() * 4.0) as usize;
            let mut ix = SuffixIndex::new(max_tokens, max_order);
            let mut live = Vec::new();
            for _ in 0..40 {
                if live.is_empty() || u() < 0.3 {
                    live.push(ix.begin());
                }
                let doc = live[(u() * live.len() as f64) as usize];
                let chunk: Vec<u32> = (0..(u() * 8.0) as usize).map(|_| (u() * 4.0) as u32).collect();
                ix.extend(doc, &chunk);
                assert!(ix.tokens() <= max_tokens, "case {case}");
                assert_eq!(ix.tokens(), ix.docs.iter().map(Vec::len).sum::<usize>(), "case {case}");
                let survivors: Vec<&[u32]> = ix.docs.iter().map(Vec::as_slice).collect();
                let fresh = index_of(&survivors, usize::MAX, max_order);
                assert_eq!(counts(&ix), counts(&fresh), "case {case}");
            }
        }
    }

    #[test]
    fn suffix_extend_after_eviction_is_ignored() {
        let mut ix = SuffixIndex::new(6, 2);
        let old = ix.begin();
        ix.extend(old, &[1, 2, 3]);
        let new = ix.begin();
        ix.extend(new, &[4, 5, 6, 7]);
        assert_eq!((ix.tokens(), ix.documents()), (4, 1));
        ix.extend(old, &[8, 9]);
        assert_eq!((ix.tokens(), ix.documents()), (4, 1));
        assert!(suffix(&ix, &[3], 1, 0.0, 2).is_empty());
        // An id the index never gave out is ignored too.
        ix.extend(DocId(99), &[1]);
        assert_eq!(ix.tokens(), 4);
    }

    #[test]
    fn suffix_a_document_alone_past_the_bound_keeps_what_fits() {
        let mut ix = SuffixIndex::new(10, 3);
        let d = ix.begin();
        ix.extend(d, &(0..25).collect::<Vec<u32>>());
        assert_eq!((ix.tokens(), ix.documents()), (10, 1));
        assert_eq!(suffix(&ix, &[7], 1, 0.0, 5), [8, 9]);
        ix.extend(d, &[1, 2]);
        assert_eq!(ix.tokens(), 10);
        // The oldest of two makes room by going.
        let e = ix.begin();
        ix.extend(e, &[50, 51]);
        assert_eq!((ix.tokens(), ix.documents()), (2, 1));
        let mut zero = SuffixIndex::new(0, 3);
        let z = zero.begin();
        zero.extend(z, &[1, 2, 3]);
        assert_eq!((zero.tokens(), zero.documents()), (0, 1));
    }

    /// Not an assertion: what one call costs, for the report (`cargo test --release -p
    /// ferry-core spec_cost -- --nocapture`).
    #[test]
    fn spec_cost_of_one_call() {
        use std::time::Instant;
        let mut u = uniforms(3);
        let history: Vec<u32> = (0..8192).map(|_| (u() * 32000.0) as u32).collect();
        let mut out = Vec::with_capacity(16);
        let reps = 200;
        let t = Instant::now();
        for _ in 0..reps {
            out.clear();
            ngram_propose(std::hint::black_box(&history), 2, 4, 8, &mut out);
        }
        let ngram_us = t.elapsed().as_secs_f64() * 1e6 / reps as f64;

        let mut ix = SuffixIndex::new(1 << 20, 8);
        let t = Instant::now();
        for chunk in history.chunks(512) {
            let d = ix.begin();
            ix.extend(d, chunk);
            ix.extend(d, chunk);
        }
        let extend_ns = t.elapsed().as_secs_f64() * 1e9 / ix.tokens() as f64;
        let context = &history[..600];
        let t = Instant::now();
        let mut n = 0;
        for _ in 0..reps * 10 {
            out.clear();
            ix.propose(std::hint::black_box(context), 1, 0.0, 8, &mut out);
            n += out.len();
        }
        let propose_us = t.elapsed().as_secs_f64() * 1e6 / (reps * 10) as f64;
        println!(
            "spec cost: ngram_propose on 8192 tokens {ngram_us:.1} us; SuffixIndex::propose k=8 \
             order 8 ({} tokens per call) {propose_us:.2} us; extend {extend_ns:.0} ns/token",
            n / (reps * 10)
        );
    }
}
