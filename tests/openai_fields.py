"""Every field of OpenAI's request schema, as the official `openai` Python package defines it,
against Ferry's field table (docs/api.md, "Request fields") and a running router.

Run by tests/cluster.rs against `ferry up`, with one JSON argument:
  base_url, api_key, model   where and how to connect (base_url ends in /v1)
  api_md                     the path of docs/api.md
For every field of `openai.types.chat.completion_create_params.CompletionCreateParamsBase`,
`openai.types.completion_create_params.CompletionCreateParamsBase` and the chat message types:
  - the field is in docs/api.md's table for that endpoint;
  - a request with a representative non-default value is judged by the table: a `supported` field
    must succeed, and where its effect shows in a 2-token answer (EFFECTS) it must have it; a
    `rejected` one must be a 400 naming it; a `limited` one is honoured for some values only: its
    sample lies outside them (a 400 naming the field), and a value inside them (LIMITED_ALLOWED)
    must succeed; a limited field that takes any value of its type (LIMITED_ANY: logged, no other
    effect) must succeed with its sample.
Every request asks for at most 2 tokens. Prints one line per field; any failure raises.
"""

import json
import re
import sys
import typing

import openai
from openai.types import completion_create_params as completion_params
from openai.types.chat import ChatCompletionMessageParam
from openai.types.chat import completion_create_params as chat_params

from openai_check import check

TOOL = {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}

# Representative non-default values, by field (then by endpoint where the types differ).
SAMPLES = {
    "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    "prompt": ["The capital of France is"],
    "audio": {"voice": "alloy", "format": "wav"},
    "frequency_penalty": 0.5,
    "presence_penalty": 0.5,
    "function_call": "auto",
    "functions": [TOOL],
    "logit_bias": {"42": -100},
    "logprobs": {"chat": True, "completions": 2},
    "max_completion_tokens": 1,
    "max_tokens": 2,
    "metadata": {"team": "ferry"},
    "modalities": ["text", "audio"],
    "moderation": {"model": "omni-moderation-latest"},
    "n": 2,
    "best_of": 2,
    "echo": True,
    "suffix": " and so on.",
    "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "Hi"},
    "prompt_cache_key": "conversation-1",
    "prompt_cache_options": {"mode": "explicit"},
    "prompt_cache_retention": "24h",
    "reasoning_effort": "high",
    "response_format": {"type": "json_object"},
    "safety_identifier": "user-hash-1",
    "seed": 7,
    "service_tier": "flex",
    "stop": ["\n\n"],
    "store": True,
    "stream_options": {"include_usage": True},
    "temperature": 0.7,
    "tool_choice": "required",
    "tools": [{"type": "function", "function": TOOL}],
    "top_logprobs": 2,
    "top_p": 0.9,
    "user": "user-1",
    "verbosity": "low",
    "web_search_options": {"search_context_size": "low"},
    # Message fields.
    "messages[].name": "bob",
    "messages[].refusal": "I cannot.",
    "messages[].audio": {"id": "audio-1"},
    "messages[].tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}],
    "messages[].tool_call_id": "c1",
    "messages[].function_call": {"name": "get_weather", "arguments": "{}"},
}


# Limited fields whose docs/api.md row allows any value of the type (logged, no other effect): the
# sample must be answered.
LIMITED_ANY = {"user", "metadata", "safety_identifier", "prompt_cache_key"}

# Every other limited field: its sample above lies outside the values docs/api.md allows (so it
# must be a 400 naming the field), and this value lies inside them (so it must be answered).
LIMITED_ALLOWED = {
    "prompt_cache_retention": "in_memory",
    "prompt_cache_options": {},
    "service_tier": "auto",
    "store": False,
    "modalities": ["text"],
    "verbosity": "medium",
    "reasoning_effort": "none",
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": {},
    "suffix": "",
}


def choice(r):
    return (r.get("choices") or [{}])[0]


# The observable effect of a supported field's sample, by (endpoint, field): (what, test of the
# answer as a dict; a streamed answer is {"chunks": [...]}).
def top_has_chosen(lp, n):
    """A completions `logprobs` whose first token's `top_logprobs` holds it and n alternatives."""
    tokens, tops = lp.get("tokens") or [], lp.get("top_logprobs") or []
    return bool(tokens and tops) and tokens[0] in tops[0] and n <= len(tops[0]) <= n + 1


EFFECTS = {
    ("chat", "n"): ("two choices", lambda r: len(r["choices"]) == 2),
    ("completions", "n"): ("two choices", lambda r: len(r["choices"]) == 2),
    ("completions", "echo"): ("the prompt first in the text", lambda r: choice(r)["text"].startswith("Hi")),
    ("chat", "logprobs"): ("log-probabilities of the tokens", lambda r: bool((choice(r).get("logprobs") or {}).get("content"))),
    # Completions map each alternative's text to its logprob and always include the chosen token:
    # 2 keys when it is among the top 2, else 3 (docs/api.md: "up to N + 1 keys").
    ("completions", "logprobs"): ("2 alternatives per token, and the chosen one", lambda r: top_has_chosen(choice(r).get("logprobs") or {}, 2)),
    ("chat", "top_logprobs"): ("2 alternatives per token", lambda r: len((((choice(r).get("logprobs") or {}).get("content") or [{}])[0]).get("top_logprobs") or []) == 2),
    ("chat", "stream_options"): ("a last chunk with the usage", lambda r: any(c.get("usage") for c in r["chunks"])),
    ("completions", "stream_options"): ("a last chunk with the usage", lambda r: any(c.get("usage") for c in r["chunks"])),
    ("chat", "max_tokens"): ("at most 2 tokens", lambda r: 1 <= r["usage"]["completion_tokens"] <= 2),
    ("completions", "max_tokens"): ("at most 2 tokens", lambda r: 1 <= r["usage"]["completion_tokens"] <= 2),
}

# Fields sent together with the one under test, by (endpoint, field).
COMPANIONS = {
    ("chat", "top_logprobs"): {"logprobs": True},
    ("chat", "tool_choice"): {"tools": SAMPLES["tools"]},
}


def sample_of_type(tp):
    """A non-default value of a type, for a field this script has no sample for (a field that
    a newer `openai` added)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        return True
    if tp is int:
        return 2
    if tp is float:
        return 0.5
    if tp is str:
        return "ferry-test"
    if origin is typing.Literal:
        return args[-1]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return sample_of_type(next(a for a in args if a is not type(None)))
    if origin is typing.Required or origin is typing.NotRequired:
        return sample_of_type(args[0])
    if origin in (list, tuple, set) or (origin and getattr(origin, "__name__", "") in ("Iterable", "Sequence")):
        return [sample_of_type(args[0])] if args else ["x"]
    if origin is dict:
        return {"k": sample_of_type(args[1])}
    if typing.is_typeddict(tp):
        hints = typing.get_type_hints(tp)
        return {k: sample_of_type(hints[k]) for k in getattr(tp, "__required_keys__", hints)}
    return {"x": 1}


def table(api_md):
    """docs/api.md's field table: {(field, endpoint): support}, endpoint "chat" or "completions"."""
    text = open(api_md, encoding="utf-8").read()
    rows = text[text.index("<!-- fields -->"):].split("\n")
    out = {}
    for line in rows[3:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        name, on, support = cells[0].strip("`"), cells[1], cells[2]
        assert support in ("supported", "limited", "rejected"), line
        for endpoint in ("chat", "completions") if on == "both" else (on,):
            out[(name, endpoint)] = support
    return out


def main():
    a = json.loads(sys.argv[1])
    client = openai.OpenAI(base_url=a["base_url"], api_key=a["api_key"], max_retries=0, timeout=120)
    model, documented = a["model"], table(a["api_md"])
    print(f"openai {openai.__version__} against {a['base_url']}: {len(documented)} table rows", flush=True)

    def send(endpoint, fields):
        """Status, error (message, param) and the answer (a dict) of one request with `fields` on
        top of a minimal one."""
        base = {"model": model, "max_tokens": 1}
        base.update({"messages": [{"role": "user", "content": "Hi"}]} if endpoint == "chat" else {"prompt": "Hi"})
        base.update(fields)
        if "stream_options" in fields:
            base["stream"] = True
        create = client.chat.completions.create if endpoint == "chat" else client.completions.create
        try:
            r = create(**base)
            if base.get("stream"):
                return 200, "", None, {"chunks": [c.model_dump() for c in r]}
            return 200, "", None, r.model_dump()
        except openai.APIStatusError as e:
            return e.status_code, str(e), getattr(e, "param", None), None

    def judge(label, field, support, status, message, param, endpoint=None, answer=None):
        names = status == 400 and (field in (param or "") or re.search(rf"\b{re.escape(field)}\b", message))
        if support == "supported":
            check(f"{label}: supported, answered", status == 200, f"{status} {message}")
            if (endpoint, field) in EFFECTS:
                what, has = EFFECTS[(endpoint, field)]
                check(f"{label}: supported, with its effect: {what}", has(answer), json.dumps(answer)[:600])
        elif support == "rejected":
            check(f"{label}: rejected with a 400 naming it", names, f"{status} {message} (param {param})")
        elif field in LIMITED_ANY:
            check(f"{label}: limited to logging, any value answered", status == 200, f"{status} {message}")
        else:
            check(f"{label}: limited, a value outside the allowed ones is a 400 naming it", names, f"{status} {message} (param {param})")
            check(f"{label}: limited: LIMITED_ALLOWED has a value it allows", field in LIMITED_ALLOWED, "add one from docs/api.md's row")
            ok, message, _, _ = send(endpoint, {field: LIMITED_ALLOWED[field]})
            check(f"{label}: limited, an allowed value ({json.dumps(LIMITED_ALLOWED[field])}) answered", ok == 200, f"{ok} {message}")

    schemas = {
        "chat": chat_params.CompletionCreateParamsBase,
        "completions": completion_params.CompletionCreateParamsBase,
    }
    seen = 0
    for endpoint, schema in schemas.items():
        hints = typing.get_type_hints(schema)
        check(f"{endpoint}: the schema has fields", len(hints) > 10, list(hints))
        for field, tp in hints.items():
            support = documented.get((field, endpoint))
            check(f"{endpoint}.{field} is in docs/api.md's table", support is not None, "add it to fields.rs and docs/api.md")
            value = model if field == "model" else SAMPLES.get(field, None)
            if isinstance(value, dict) and set(value) == {"chat", "completions"}:
                value = value[endpoint]
            if field not in SAMPLES and field != "model":
                value = sample_of_type(tp)
            # A field that only means something with another one is sent with it (as OpenAI,
            # Ferry refuses `top_logprobs` without `logprobs: true`).
            fields = {field: value, **COMPANIONS.get((endpoint, field), {})}
            status, message, param, answer = send(endpoint, fields)
            judge(f"{endpoint}.{field} = {json.dumps(value)[:40]}", field, support, status, message, param, endpoint, answer)
            seen += 1

    # The fields of every kind of chat message.
    for message_type in typing.get_args(ChatCompletionMessageParam):
        hints = typing.get_type_hints(message_type)
        role = typing.get_args(hints["role"])[0]
        for field, tp in hints.items():
            if field in ("role", "content"):
                continue
            key = f"messages[].{field}"
            support = documented.get((key, "chat"))
            check(f"{key} ({role}) is in docs/api.md's table", support is not None, "add it to fields.rs and docs/api.md")
            value = SAMPLES[key] if key in SAMPLES else sample_of_type(tp)
            msg = {"role": role, "content": "Hi", field: value}
            status, message, param, answer = send("chat", {"messages": [msg]})
            judge(f"{key} ({role})", field, support, status, message, param, endpoint="chat", answer=answer)
            seen += 1

    # A field that is nowhere in the schema.
    status, message, param, _ = send("chat", {"extra_body": {"temprature": 0.1}})
    check("an unknown field is a 400 naming it", status == 400 and param == "temprature" and 'unknown field "temprature"' in message, message)
    print(f"all {seen} fields checked", flush=True)
    print("all checks passed", flush=True)


if __name__ == "__main__":
    main()
