//! Wire messages <-> `ferry-core` types.

use crate::v1;
use ferry_core::sampling::OutputGrammar;
use ferry_core::{KvTier, SamplingParams, TokenLogprob};

/// The token budget when a request leaves `max_tokens` at 0.
pub const DEFAULT_MAX_TOKENS: usize = 128;

/// Sampling and stop conditions from the wire, converted and validated: what every edge that
/// takes them (the router's gRPC and HTTP APIs, the prefill and decode services) runs, once.
pub fn checked_sampling(s: Option<&v1::SamplingParams>, stop: Option<&v1::StopConditions>) -> Result<SamplingParams, ferry_core::sampling::SamplingError> {
    let params = sampling_from_wire(s, stop);
    params.validate()?;
    Ok(params)
}

/// Sampling and stop conditions from the wire into one [`SamplingParams`] (not yet validated;
/// the edges use [`checked_sampling`]).
pub fn sampling_from_wire(s: Option<&v1::SamplingParams>, stop: Option<&v1::StopConditions>) -> SamplingParams {
    let d = SamplingParams::default();
    let s = s.cloned().unwrap_or_default();
    let stop = stop.cloned().unwrap_or_default();
    SamplingParams {
        temperature: s.temperature,
        top_k: s.top_k as usize,
        top_p: s.top_p.unwrap_or(d.top_p),
        seed: s.seed,
        max_tokens: if stop.max_tokens == 0 { DEFAULT_MAX_TOKENS } else { stop.max_tokens as usize },
        stop_token_ids: stop.stop_token_ids,
        stop_strings: stop.stop,
        ignore_eos: stop.ignore_eos,
        token_offset: s.token_offset,
        grammar: s.structured.as_ref().and_then(grammar_from_wire),
        logprobs: s.logprobs,
        prompt_logprobs: s.prompt_logprobs,
        // Unset (0) is one completion.
        n: s.n.max(1),
        frequency_penalty: s.frequency_penalty,
        presence_penalty: s.presence_penalty,
        repetition_penalty: s.repetition_penalty.unwrap_or(d.repetition_penalty),
        logit_bias: {
            let mut bias: Vec<(u32, f32)> = s.logit_bias.into_iter().collect();
            bias.sort_by_key(|&(t, _)| t);
            bias
        },
        min_p: s.min_p,
        min_tokens: stop.min_tokens as usize,
        bad_words: s.bad_words,
    }
}

/// The grammar a `StructuredOutput` asks for (None when its `kind` is unset).
pub fn grammar_from_wire(s: &v1::StructuredOutput) -> Option<OutputGrammar> {
    use v1::structured_output::Kind;
    Some(match s.kind.as_ref()? {
        Kind::JsonSchema(t) => OutputGrammar::JsonSchema(t.clone()),
        Kind::JsonObject(_) => OutputGrammar::JsonObject,
        Kind::Regex(r) => OutputGrammar::Regex(r.clone()),
        Kind::Lark(l) => OutputGrammar::Lark(l.clone()),
        Kind::Choice(c) => OutputGrammar::Choice(c.choices.clone()),
    })
}

/// The wire form of an [`OutputGrammar`].
pub fn grammar_to_wire(g: &OutputGrammar) -> v1::StructuredOutput {
    use v1::structured_output::Kind;
    let kind = match g {
        OutputGrammar::JsonSchema(t) => Kind::JsonSchema(t.clone()),
        OutputGrammar::JsonObject => Kind::JsonObject(true),
        OutputGrammar::Regex(r) => Kind::Regex(r.clone()),
        OutputGrammar::Lark(l) => Kind::Lark(l.clone()),
        OutputGrammar::Choice(c) => Kind::Choice(v1::Choices { choices: c.clone() }),
    };
    v1::StructuredOutput { kind: Some(kind) }
}

/// The wire form of [`SamplingParams`]: (sampling, stop conditions).
pub fn sampling_to_wire(p: &SamplingParams) -> (v1::SamplingParams, v1::StopConditions) {
    (
        v1::SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k as u32,
            top_p: Some(p.top_p),
            seed: p.seed,
            token_offset: p.token_offset,
            structured: p.grammar.as_ref().map(grammar_to_wire),
            logprobs: p.logprobs,
            prompt_logprobs: p.prompt_logprobs,
            n: p.n,
            frequency_penalty: p.frequency_penalty,
            presence_penalty: p.presence_penalty,
            repetition_penalty: Some(p.repetition_penalty),
            logit_bias: p.logit_bias.iter().copied().collect(),
            min_p: p.min_p,
            bad_words: p.bad_words.clone(),
        },
        v1::StopConditions {
            max_tokens: p.max_tokens.min(u32::MAX as usize) as u32,
            stop: p.stop_strings.clone(),
            stop_token_ids: p.stop_token_ids.clone(),
            ignore_eos: p.ignore_eos,
            min_tokens: p.min_tokens.min(u32::MAX as usize) as u32,
        },
    )
}

/// A token's log-probability on the wire.
pub fn logprob_to_wire(l: &TokenLogprob) -> v1::TokenLogprob {
    v1::TokenLogprob {
        token_id: l.token,
        logprob: l.logprob,
        top: l.top.iter().map(|&(token_id, logprob)| v1::TopLogprob { token_id, logprob }).collect(),
    }
}

/// A token's log-probability from the wire.
pub fn logprob_from_wire(l: &v1::TokenLogprob) -> TokenLogprob {
    TokenLogprob { token: l.token_id, logprob: l.logprob, top: l.top.iter().map(|t| (t.token_id, t.logprob)).collect() }
}

impl std::fmt::Display for v1::WorkerRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            v1::WorkerRole::Unspecified => "unspecified",
            v1::WorkerRole::Prefill => "prefill",
            v1::WorkerRole::Decode => "decode",
            v1::WorkerRole::Colocated => "colocated",
        })
    }
}

impl std::fmt::Display for v1::WorkerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            v1::WorkerState::Unspecified => "unspecified",
            v1::WorkerState::Ready => "ready",
            v1::WorkerState::Draining => "draining",
            v1::WorkerState::Dead => "dead",
        })
    }
}

impl std::fmt::Display for v1::KvTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            v1::KvTransport::Unspecified => "unspecified",
            v1::KvTransport::Grpc => "grpc",
            v1::KvTransport::Tcp => "tcp",
            v1::KvTransport::Nccl => "nccl",
            v1::KvTransport::CudaIpc => "cuda-ipc",
        })
    }
}

impl std::fmt::Display for v1::FinishReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            v1::FinishReason::Unspecified => "unspecified",
            v1::FinishReason::Length => "length",
            v1::FinishReason::StopToken => "stop",
            v1::FinishReason::StopString => "stop_string",
            v1::FinishReason::ContextFull => "context_full",
        })
    }
}

/// A prefix-cache tier on the wire.
pub fn kv_tier_to_wire(t: KvTier) -> v1::KvTier {
    match t {
        KvTier::Pool => v1::KvTier::Pool,
        KvTier::Disk => v1::KvTier::Disk,
    }
}

/// A prefix-cache tier from the wire (`KvCacheEvent.tier`); None for a value this build does
/// not know (a newer worker's tier: its events are not applied).
pub fn kv_tier_from_wire(t: i32) -> Option<KvTier> {
    match v1::KvTier::try_from(t).ok()? {
        v1::KvTier::Pool => Some(KvTier::Pool),
        v1::KvTier::Disk => Some(KvTier::Disk),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_round_trips_and_defaults_apply() {
        let p = SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            seed: Some(7),
            max_tokens: 33,
            stop_token_ids: vec![5],
            stop_strings: vec!["\n\n".into()],
            ignore_eos: true,
            token_offset: 5,
            grammar: None,
            logprobs: Some(3),
            prompt_logprobs: Some(0),
            n: 4,
            frequency_penalty: 0.5,
            presence_penalty: -0.25,
            repetition_penalty: 1.3,
            logit_bias: vec![(2, -100.0), (7, 3.5)],
            min_p: 0.05,
            min_tokens: 4,
            bad_words: vec!["word".into()],
        };
        let (s, st) = sampling_to_wire(&p);
        assert_eq!(sampling_from_wire(Some(&s), Some(&st)), p);
        for g in [
            OutputGrammar::JsonSchema("{}".into()),
            OutputGrammar::JsonObject,
            OutputGrammar::Regex("a+".into()),
            OutputGrammar::Lark("start: \"x\"".into()),
            OutputGrammar::Choice(vec!["a".into(), "b".into()]),
        ] {
            let p = SamplingParams { grammar: Some(g), ..p.clone() };
            let (s, st) = sampling_to_wire(&p);
            assert_eq!(sampling_from_wire(Some(&s), Some(&st)), p);
        }
        let d = sampling_from_wire(None, None);
        assert_eq!(d.max_tokens, DEFAULT_MAX_TOKENS);
        assert_eq!(d.top_p, 1.0);
        assert_eq!(d.temperature, 0.0);
        assert_eq!((d.logprobs, d.prompt_logprobs, d.n), (None, None, 1));
        assert_eq!(d, SamplingParams { max_tokens: DEFAULT_MAX_TOKENS, ..SamplingParams::default() });
    }

    #[test]
    fn kv_tiers_round_trip() {
        for t in KvTier::ALL {
            assert_eq!(kv_tier_from_wire(kv_tier_to_wire(t) as i32), Some(t));
        }
        assert_eq!(kv_tier_from_wire(0), Some(KvTier::Pool), "events before the field are the pool's");
        assert_eq!(kv_tier_from_wire(7), None);
    }

    #[test]
    fn logprobs_round_trip() {
        let l = TokenLogprob { token: 9, logprob: -0.25, top: vec![(9, -0.25), (4, -1.5)] };
        assert_eq!(logprob_from_wire(&logprob_to_wire(&l)), l);
    }
}
