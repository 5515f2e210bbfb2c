#!/usr/bin/env python3
"""Peer benchmark: llama.cpp (llama-cpp-python) on the same GGUF and machine as `ferry bench engine`.

Prints one JSON line with prefill tok/s (a prompt of --prompt-len tokens, one eval) and decode
tok/s (--gen greedy tokens, one eval per token), medians over --repeats, like Ferry's benchmark.

    python3 -m pip install llama-cpp-python==0.3.36   # builds llama.cpp from source
    python3 scripts/bench_llamacpp.py --model ~/.cache/ferry/models/SmolLM2-135M-Instruct.Q4_1.gguf --threads 2
"""
import argparse
import json
import statistics
import time

import numpy as np
from llama_cpp import Llama

TEXT = ("The history of the printing press begins with the first movable type, invented in China, and "
        "continues through Gutenberg's workshop in Mainz, where metal type, oil-based ink and a wooden "
        "screw press came together. ")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    llm = Llama(model_path=a.model, n_ctx=a.prompt_len + a.gen + 16, n_threads=a.threads,
                n_threads_batch=a.threads, n_batch=a.prompt_len, n_ubatch=a.prompt_len,
                logits_all=False, verbose=False)
    base = llm.tokenize(TEXT.encode(), add_bos=False)
    prompt = (base * (a.prompt_len // len(base) + 1))[: a.prompt_len]
    prefill, decode = [], []
    for _ in range(a.repeats):
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        prefill.append(len(prompt) / (time.perf_counter() - t))
    for _ in range(a.repeats):
        llm.reset()
        llm.eval(prompt[:16])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t = time.perf_counter()
        for _ in range(a.gen - 1):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        decode.append((a.gen - 1) / (time.perf_counter() - t))
    print(json.dumps({"bench": "llama.cpp", "threads": a.threads, "prompt_len": a.prompt_len, "gen": a.gen,
                      "prefill_tok_s": round(statistics.median(prefill), 1),
                      "decode_tok_s": round(statistics.median(decode), 1)}))


if __name__ == "__main__":
    main()
