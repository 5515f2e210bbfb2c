"""Ferry's OpenAI-compatible HTTP API through the official `openai` Python client.

Run by tests/cluster.rs against a running `ferry up`, with one JSON argument:
  base_url, api_key, model   where and how to connect (base_url ends in /v1)
  prompt, max_tokens         a completion request (greedy)
  expect_text                what Ferry's gRPC API answered for it
  expect_prompt_tokens, expect_completion_tokens, expect_finish
  chat, expect_chat          a user message and the gRPC API's greedy answer to it
  stop                       a string inside expect_text, to check `stop`
Prints one line per check; any failure raises (non-zero exit).
"""

import json
import sys

import openai

from openai_check import check


def main():
    a = json.loads(sys.argv[1])
    client = openai.OpenAI(base_url=a["base_url"], api_key=a["api_key"], max_retries=0, timeout=300)
    model, prompt, n = a["model"], a["prompt"], a["max_tokens"]
    print(f"openai {openai.__version__} against {a['base_url']}", flush=True)

    models = client.models.list()
    check("models.list names the served model", [m.id for m in models.data] == [model], models)

    # Completions, whole.
    r = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0)
    c = r.choices[0]
    check("completion text is non-empty", c.text != "", r)
    check("completion equals the gRPC API's greedy text", c.text == a["expect_text"], f"{c.text!r} != {a['expect_text']!r}")
    check("completion finish_reason", c.finish_reason == a["expect_finish"], c.finish_reason)
    u = r.usage
    check(
        "completion usage",
        (u.prompt_tokens, u.completion_tokens, u.total_tokens)
        == (a["expect_prompt_tokens"], a["expect_completion_tokens"], a["expect_prompt_tokens"] + a["expect_completion_tokens"]),
        u,
    )
    check("completion id and object", r.id.startswith("cmpl-") and r.object == "text_completion", r)

    # Completions, streamed, with the usage chunk.
    text, finish, usage, chunks = "", None, None, 0
    for ch in client.completions.create(
        model=model, prompt=prompt, max_tokens=n, temperature=0, stream=True, stream_options={"include_usage": True}
    ):
        chunks += 1
        if ch.choices:
            text += ch.choices[0].text
            finish = ch.choices[0].finish_reason or finish
        if ch.usage is not None:
            usage = ch.usage
    check("streamed completion arrives in pieces", chunks > 2, chunks)
    check("streamed completion equals the whole one", text == a["expect_text"], f"{text!r}")
    check("streamed completion finish_reason", finish == a["expect_finish"], finish)
    check("streamed completion usage", usage is not None and usage.completion_tokens == a["expect_completion_tokens"], usage)

    # A stop string ends the text before it and is not returned.
    r = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, stop=[a["stop"]])
    want = a["expect_text"].split(a["stop"])[0]
    check("stop is honoured", r.choices[0].text == want, f"{r.choices[0].text!r} != {want!r}")
    check("stop gives finish_reason stop", r.choices[0].finish_reason == "stop", r.choices[0].finish_reason)

    # Chat, whole and streamed.
    messages = [{"role": "user", "content": a["chat"]}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=n, temperature=0)
    m = r.choices[0].message
    check("chat answer is non-empty", bool(m.content), r)
    check("chat role", m.role == "assistant", m.role)
    check("chat equals the gRPC API's greedy answer", m.content == a["expect_chat"], f"{m.content!r} != {a['expect_chat']!r}")
    check("chat finish_reason", r.choices[0].finish_reason in ("stop", "length"), r.choices[0].finish_reason)
    check("chat usage", r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0, r.usage)
    check("chat id and object", r.id.startswith("chatcmpl-") and r.object == "chat.completion", r)

    # The conversation's next turn repeats this one: the prefix cache serves at least its whole
    # 16-token blocks, and usage says so (the first turn's own count is whatever an earlier
    # request left cached).
    turn2 = messages + [{"role": "assistant", "content": m.content}, {"role": "user", "content": "Tell me more."}]
    r2 = client.chat.completions.create(model=model, messages=turn2, max_tokens=n, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    check(
        "a second turn's prompt is served from the prefix cache",
        r.usage.prompt_tokens // 16 * 16 <= cached < r2.usage.prompt_tokens,
        (r.usage, r2.usage),
    )

    text, role, finish = "", None, None
    for ch in client.chat.completions.create(model=model, messages=messages, max_tokens=n, temperature=0, stream=True):
        d = ch.choices[0].delta
        role = role or d.role
        text += d.content or ""
        finish = ch.choices[0].finish_reason or finish
    check("streamed chat starts with the assistant role", role == "assistant", role)
    check("streamed chat equals the whole one", text == a["expect_chat"], f"{text!r}")
    check("streamed chat finish_reason", finish in ("stop", "length"), finish)

    # Logprobs: chat with top_logprobs, greedy, so each token's first alternative is itself.
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=n, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    check("chat logprobs: one entry per token", len(content) == r.usage.completion_tokens, (len(content), r.usage))
    check(
        "chat logprobs are well formed",
        all(e.logprob <= 0 and len(e.top_logprobs) == 3 and bytes(e.bytes).decode("utf-8", "replace") == e.token for e in content),
        content,
    )
    check(
        "chat logprobs: greedy top-1 is the chosen token",
        all(e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob for e in content),
        content,
    )
    check("chat logprobs spell the answer", "".join(e.token for e in content) == r.choices[0].message.content, content)
    streamed = []
    for ch in client.chat.completions.create(
        model=model, messages=messages, max_tokens=n, temperature=0, logprobs=True, top_logprobs=3, stream=True
    ):
        if ch.choices and ch.choices[0].logprobs and ch.choices[0].logprobs.content:
            streamed += ch.choices[0].logprobs.content
    check(
        "streamed chat logprobs equal the whole answer's",
        [e.token for e in streamed] == [e.token for e in content]
        and all(abs(a.logprob - b.logprob) <= 1e-4 for a, b in zip(streamed, content)),
        streamed,
    )

    # Completions with echo: the prompt's tokens come first, the first one without a logprob.
    r = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=2)
    c = r.choices[0]
    lp = c.logprobs
    check("echo returns the prompt first", c.text.startswith(prompt) and len(c.text) > len(prompt), c.text)
    check("echo logprobs cover prompt and completion", len(lp.tokens) == r.usage.prompt_tokens + 1 == len(lp.token_logprobs), lp)
    check("the first prompt token has no logprob", lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, lp)
    check("prompt logprobs are numbers", all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:]), lp.token_logprobs)
    check("echo top_logprobs hold 2 alternatives and the chosen token", all(2 <= len(t) <= 3 for t in lp.top_logprobs[1:]), lp.top_logprobs)
    check("greedy completion token is the top one", lp.token_logprobs[-1] == max(lp.top_logprobs[-1].values()), lp)
    check("text_offset starts at 0 and grows", lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset), lp.text_offset)
    try:
        client.chat.completions.create(model=model, messages=messages, max_tokens=2, logprobs=True, top_logprobs=21)
        raise AssertionError("top_logprobs=21 was accepted")
    except openai.BadRequestError as e:
        check("top_logprobs=21 raises BadRequestError naming it", e.status_code == 400 and "top_logprobs" in str(e), e)

    # Errors become the client's exceptions.
    try:
        client.completions.create(model="gpt-17", prompt=prompt, max_tokens=2)
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        check("unknown model raises NotFoundError", e.status_code == 404 and "gpt-17" in str(e), e)
    try:
        client.completions.create(model=model, prompt=prompt, max_tokens=2, n=17)
        raise AssertionError("n=17 was accepted")
    except openai.BadRequestError as e:
        check("n=17 raises BadRequestError naming n", e.status_code == 400 and "`n`" in str(e), e)

    # Several choices: one prefill, three sampled continuations. Choice i is the one-choice
    # request with seed + i; usage counts every choice's tokens once the prompt.
    kw = dict(model=model, messages=messages, max_tokens=n, temperature=1.0, logprobs=True)
    r = client.chat.completions.create(n=3, seed=40, **kw)
    check("n=3 answers three choices, indexed", [c.index for c in r.choices] == [0, 1, 2], r.choices)
    texts = [c.message.content for c in r.choices]
    check("sampled choices differ", len(set(texts)) > 1, texts)
    alone = [client.chat.completions.create(n=1, seed=40 + i, **kw).choices[0].message.content for i in range(3)]
    check("choice i equals the request with seed + i", texts == alone, (texts, alone))
    tokens = sum(len(c.logprobs.content) for c in r.choices)
    check("usage counts every choice's tokens", r.usage.completion_tokens == tokens and r.usage.total_tokens == tokens + r.usage.prompt_tokens, (r.usage, tokens))
    streamed, finishes, usage = ["", "", ""], [None] * 3, None
    for ch in client.chat.completions.create(n=3, seed=40, stream=True, stream_options={"include_usage": True}, **kw):
        for c in ch.choices:
            streamed[c.index] += c.delta.content or ""
            finishes[c.index] = c.finish_reason or finishes[c.index]
        usage = ch.usage or usage
    check("streamed choices equal the whole ones", streamed == texts, (streamed, texts))
    check("each streamed choice finishes", all(f in ("stop", "length") for f in finishes), finishes)
    check("the streamed usage counts every choice", usage is not None and usage.completion_tokens == r.usage.completion_tokens, usage)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, n=2)
    check("greedy choices are alike", [c.text for c in r.choices] == [a["expect_text"]] * 2, r.choices)
    bad = openai.OpenAI(base_url=a["base_url"], api_key="not-the-key", max_retries=0)
    try:
        bad.models.list()
        raise AssertionError("a wrong API key was accepted")
    except openai.AuthenticationError as e:
        check("a wrong key raises AuthenticationError", e.status_code == 401, e)
    print("all checks passed", flush=True)


if __name__ == "__main__":
    main()
