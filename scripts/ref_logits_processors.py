#!/usr/bin/env python3
"""Reference outputs for Ferry's logits processors and sampler cuts, made by implementations Ferry
did not write: HF transformers' logits processors and warpers, and SGLang's penalizers (frequency
and presence penalty, which transformers has none of).

Writes tests/fixtures/processors/<model>.json: for a golden model, the HF logits at its prompt's
last position and, for each case, the processed logits (bad words, min_tokens, logit bias,
penalties; -inf as null) or the sampling distribution after temperature, min_p, top-k and top-p;
and HF `generate` greedy ids under a repetition penalty (the whole engine path).

Needs torch, transformers and the SGLang wheel's penaltylib (pure torch; imported without the rest
of SGLang). Run once, offline from Ferry:

    python -m venv /tmp/hfref && /tmp/hfref/bin/pip install torch transformers
    /tmp/hfref/bin/pip download sglang --no-deps -d /tmp/sgl && (cd /tmp/sgl && unzip -o sglang-*.whl 'sglang/srt/sampling/penaltylib/*' -d x)
    /tmp/hfref/bin/python scripts/ref_logits_processors.py --sglang /tmp/sgl/x tests/fixtures/golden/llama-gqa
"""

import argparse
import json
import math
import pathlib
import sys
import types

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, __version__ as hf_version
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


def sglang_penalizers(root):
    """SGLang's frequency and presence penalizers, with the two helpers they import from the rest
    of SGLang stubbed (pinned memory: off on CPU; compiler backend: unused here)."""
    pkg = pathlib.Path(root) / "sglang"
    for name, path in [("sglang", pkg), ("sglang.srt", pkg / "srt"), ("sglang.srt.sampling", pkg / "srt" / "sampling")]:
        m = types.ModuleType(name)
        m.__path__ = [str(path)]
        sys.modules[name] = m
    utils = types.ModuleType("sglang.srt.utils")
    utils.__path__ = []
    utils.get_compiler_backend = lambda: "inductor"
    utils.is_npu = lambda: False
    common = types.ModuleType("sglang.srt.utils.common")
    common.is_pin_memory_available = lambda device=None: False
    sys.modules["sglang.srt.utils"] = utils
    sys.modules["sglang.srt.utils.common"] = common
    from sglang.srt.sampling.penaltylib import (
        BatchedFrequencyPenalizer,
        BatchedPenalizerOrchestrator,
        BatchedPresencePenalizer,
    )

    class Batch:  # the orchestrator holds its batch by weak reference
        def __init__(self, reqs):
            self.device, self.reqs = "cpu", reqs

    def apply(logits, output, frequency, presence):
        req = types.SimpleNamespace(sampling_params=types.SimpleNamespace(frequency_penalty=frequency, presence_penalty=presence))
        batch = Batch([req])
        orch = BatchedPenalizerOrchestrator(logits.shape[-1], batch, {BatchedFrequencyPenalizer, BatchedPresencePenalizer})
        for t in output:
            orch.cumulate_output_tokens(torch.tensor([t]))
        out = logits.clone()[None]
        orch.apply(out)
        return out[0]

    return apply


def listed(t):
    return [None if math.isinf(x) and x < 0 else x for x in t.tolist()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sglang", required=True, help="folder holding the extracted sglang/srt/sampling/penaltylib")
    ap.add_argument("model", help="a golden model folder (config, weights, golden.safetensors)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    penalize = sglang_penalizers(a.sglang)
    model_dir = pathlib.Path(a.model)
    golden = load_file(str(model_dir / "golden.safetensors"))
    ids = golden["input_ids"].tolist()
    logits = golden["logits"][-1].to(torch.float32)
    vocab = logits.shape[0]
    # The prompt's last 8 ids stand for output generated earlier (token_offset 8): frequency and
    # presence count only those; repetition, all 41.
    offset = 8
    prompt, output = ids[: len(ids) - offset], ids[len(ids) - offset :]
    seq = torch.tensor([ids])
    stop_ids = [0, 2]

    def hf(proc, scores):
        return proc(seq, scores.clone()[None])[0]

    cases = []

    def case(name, params, processed, bad_words_ids=None):
        cases.append({"name": name, "params": params, "bad_words_ids": bad_words_ids or [], "stop_ids": stop_ids, "processed": listed(processed)})

    case("repetition_penalty", {"repetition_penalty": 1.3}, hf(RepetitionPenaltyLogitsProcessor(1.3), logits))
    case("repetition_penalty_below_one", {"repetition_penalty": 0.8}, hf(RepetitionPenaltyLogitsProcessor(0.8), logits))
    case("frequency_penalty", {"frequency_penalty": 0.7}, penalize(logits, output, 0.7, 0.0))
    case("presence_penalty", {"presence_penalty": -0.9}, penalize(logits, output, 0.0, -0.9))
    bias = {5: 3.0, 17: -100.0, 300: 7.5}
    case("logit_bias", {"logit_bias": [[k, v] for k, v in bias.items()]}, hf(SequenceBiasLogitsProcessor({(k,): v for k, v in bias.items()}), logits))
    # min_tokens 20 with 8 generated: the stop ids are banned (HF counts new tokens past the prompt).
    case("min_tokens", {"min_tokens": 20}, hf(MinNewTokensLengthLogitsProcessor(len(prompt), 20, stop_ids), logits))
    case("min_tokens_met", {"min_tokens": 8}, hf(MinNewTokensLengthLogitsProcessor(len(prompt), 8, stop_ids), logits))
    # Bad words: one single token, one pair whose first token ends the output (so its second is
    # banned), one pair that does not match.
    bad = [[7], [output[-1], 11], [output[-2], 13]]
    case("bad_words", {}, hf(NoBadWordsLogitsProcessor(bad, eos_token_id=stop_ids), logits), bad_words_ids=bad)
    # Everything at once, in vLLM's order: bad words, min_tokens, bias, then the penalties.
    x = hf(NoBadWordsLogitsProcessor(bad, eos_token_id=stop_ids), logits)
    x = hf(MinNewTokensLengthLogitsProcessor(len(prompt), 20, stop_ids), x)
    x = hf(SequenceBiasLogitsProcessor({(k,): v for k, v in bias.items()}), x)
    x = hf(RepetitionPenaltyLogitsProcessor(1.3), x)
    x = penalize(x, output, 0.7, -0.9)
    all_params = {"repetition_penalty": 1.3, "frequency_penalty": 0.7, "presence_penalty": -0.9, "logit_bias": [[k, v] for k, v in bias.items()], "min_tokens": 20}
    case("all_processors", all_params, x, bad_words_ids=bad)

    # The sampler's cuts: the distribution a draw chooses from (temperature, min_p, top-k, top-p).
    dists = []
    for name, t, min_p, top_k, top_p in [
        ("min_p", 0.7, 0.1, 0, 1.0),
        ("min_p_hot", 1.5, 0.05, 0, 1.0),
        ("min_p_top_k_top_p", 0.9, 0.02, 40, 0.9),
        ("top_p_only", 1.0, 0.0, 0, 0.8),
    ]:
        s = TemperatureLogitsWarper(t)(seq, logits.clone()[None])
        if min_p > 0:
            s = MinPLogitsWarper(min_p)(seq, s)
        if top_k > 0:
            s = TopKLogitsWarper(top_k)(seq, s)
        if top_p < 1.0:
            s = TopPLogitsWarper(top_p)(seq, s)
        probs = torch.softmax(s[0].double(), -1)
        kept = [(i, p) for i, p in enumerate(probs.tolist()) if p > 0]
        dists.append({"name": name, "params": {"temperature": t, "min_p": min_p, "top_k": top_k, "top_p": top_p}, "probs": kept})

    # The whole engine path: HF greedy generate under a repetition penalty (the prompt counts).
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    gen = []
    for penalty in [1.3, 2.0]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=24, do_sample=False, repetition_penalty=penalty, pad_token_id=0, eos_token_id=None)
        gen.append({"repetition_penalty": penalty, "greedy_ids": out[0, len(ids) :].tolist()})

    doc = {
        "source": f"transformers {hf_version}, torch {torch.__version__}, SGLang penaltylib; scripts/ref_logits_processors.py",
        "model": model_dir.name,
        "input_ids": ids,
        "token_offset": offset,
        "vocab": vocab,
        "logits": logits.tolist(),
        "processors": cases,
        "distributions": dists,
        "generate": gen,
    }
    out = pathlib.Path(a.out or f"tests/fixtures/processors/{model_dir.name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc))
    print(f"wrote {out}: {len(cases)} processor cases, {len(dists)} distributions, {len(gen)} generations")


if __name__ == "__main__":
    main()
