#!/usr/bin/env python3
"""HF transformers (sdpa attention) on the same shapes as `ferry bench engine --model synthetic:NAME
--device cuda`: random bf16 weights made on the GPU, prefill of one prompt, greedy decode at
batch 1 and at --batch, and the GPU's limits measured in the same run (a device copy for the
memory bandwidth, an 8192^3 bf16 matmul for the peak). Prints one JSON line.

The peer Ferry's GPU figures are compared with in docs/benchmarks.md. Needs torch (CUDA) and
transformers; nothing is downloaded. """
import argparse
import json
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

# Shapes (as in ferry-engine/src/loader/synthetic.rs), and their Llama-3 RoPE: theta, scaling factor.
PRESETS = {
    "llama3-8b": (dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
                       tie_word_embeddings=False), 500000.0, 8.0),
    "llama3-1b": (dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=8192,
                       tie_word_embeddings=True), 500000.0, 32.0),
}


def llama_config(name):
    shapes, theta, factor = PRESETS[name]
    rope = dict(rope_type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)
    kw = dict(shapes)
    if int(transformers.__version__.split(".")[0]) >= 5:
        kw["rope_parameters"] = dict(rope, rope_theta=theta)  # transformers 5 keeps theta with the scaling
    else:
        kw["rope_theta"], kw["rope_scaling"] = theta, rope
    cfg = LlamaConfig(**kw)
    cfg._attn_implementation = "sdpa"
    return cfg


def cuda_time(fn, repeats):
    """Best wall time of `fn` over `repeats` runs after one warm-up, synchronizing around each."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3-8b", choices=sorted(PRESETS))
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    dev = torch.device("cuda")

    # The limits.
    n = (4 << 30) // 4
    src, dst = torch.zeros(n, dtype=torch.int32, device=dev), torch.empty(n, dtype=torch.int32, device=dev)
    copy_s = cuda_time(lambda: dst.copy_(src), 5)
    copy_bw = 2 * n * 4 / copy_s
    del src, dst
    m = 8192
    x = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    y = torch.randn(m, m, dtype=torch.bfloat16, device=dev)
    peak = 2 * m ** 3 / cuda_time(lambda: torch.matmul(x, y), 10)
    del x, y

    cfg = llama_config(a.model)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # made in bf16 on the GPU, not in f32 then cast
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    weight_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "embed_tokens" not in name)
    if cfg.tie_word_embeddings:
        weight_bytes += model.model.embed_tokens.weight.numel() * 2

    g = torch.Generator(device=dev).manual_seed(1)
    prompt = torch.randint(2, cfg.vocab_size, (1, a.prompt_len), device=dev, generator=g)
    with torch.no_grad():
        # Prefill: the whole prompt, logits of the last position only (as Ferry's prefill).
        prefill_s = cuda_time(lambda: model(prompt, use_cache=True, logits_to_keep=1), a.repeats)

        def decode(batch):
            ids = torch.randint(2, cfg.vocab_size, (batch, 16), device=dev, generator=g)
            out = model(ids, use_cache=True, logits_to_keep=1)
            past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(a.gen):
                out = model(nxt, past_key_values=past, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            torch.cuda.synchronize()
            return batch * a.gen / (time.perf_counter() - t)

        decode(1)  # warm-up
        d1 = max(decode(1) for _ in range(a.repeats))
        db = max(decode(a.batch) for _ in range(a.repeats))

    hid, q, kv, ff = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    t = a.prompt_len
    flops = cfg.num_hidden_layers * (2 * (hid * q + 2 * hid * kv + q * hid + 3 * hid * ff) * t + 2 * q * t * (t + 1)) + 2 * hid * cfg.vocab_size
    roofline = copy_bw / weight_bytes
    r = lambda v, k=1: round(v, k)
    print(json.dumps({
        "bench": "hf_transformers_gpu", "model": f"synthetic:{a.model}", "torch": torch.__version__,
        "transformers": transformers.__version__, "device": torch.cuda.get_device_name(0),
        "attention": cfg._attn_implementation, "prompt_len": a.prompt_len, "gen": a.gen, "batch": a.batch,
        "prefill_tok_s": r(t / prefill_s), "prefill_tflop_s": r(flops / prefill_s / 1e12),
        "bf16_gemm_peak_tflop_s": r(peak / 1e12), "prefill_peak_fraction": r(flops / prefill_s / peak, 3),
        "decode_tok_s": r(d1), "batch_decode_tok_s": r(db), "weight_bytes_per_decode_step": weight_bytes,
        "copy_gb_s": r(copy_bw / 1e9), "decode_roofline_tok_s": r(roofline), "roofline_fraction": r(d1 / roofline, 3),
        "batch_roofline_fraction": r(db / (a.batch * roofline), 3),
    }))


if __name__ == "__main__":
    main()
