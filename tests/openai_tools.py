"""Tool calling through the official `openai` Python client.

Run by tests/cluster.rs against a running `ferry up`, with one JSON argument:
  base_url, api_key, model   where and how to connect (base_url ends in /v1)
  takes_tools                true: the model's chat template takes tools (a tiny random model given
                             vLLM's Hermes template, tests/fixtures/tools); false: it takes none
                             (SmolLM2's ChatML template)
With tools: `tool_choice` "required" and a named function give calls whose arguments are JSON
valid against the function's schema, `finish_reason` "tool_calls"; a stream accumulates to the
same calls as the same greedy request without `stream`; a conversation holding an assistant's
calls and a tool's result is accepted; "auto" answers; bad choices are 400s naming the field.
Without: Ferry's generic format: forced and named calls valid against their schemas, a streamed
call's arguments in pieces adding up to the whole answer's, "auto" well formed, "none" plain chat. Every request is bounded by `max_tokens`. Prints one line per check; any failure
raises (non-zero exit).
"""

import json
import sys

import openai

from openai_check import check

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name.", "maxLength": 16},
                "unit": {"type": "string", "description": "Degrees.", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "description": "An IANA zone.", "maxLength": 16}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]


def valid(name, arguments):
    """Whether `arguments` (JSON text) is valid against the schema of the tool `name`."""
    tool = next((t["function"] for t in TOOLS if t["function"]["name"] == name), None)
    if tool is None:
        return False
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return False
    schema = tool["parameters"]
    props = schema["properties"]
    if not isinstance(args, dict) or set(args) - set(props) or set(schema["required"]) - set(args):
        return False
    for key, value in args.items():
        p = props[key]
        if not isinstance(value, str) or len(value) > p.get("maxLength", 1 << 30):
            return False
        if "enum" in p and value not in p["enum"]:
            return False
    return True


def calls_of(message):
    return [(c.function.name, c.function.arguments) for c in (message.tool_calls or [])]


def check_calls(label, message, allowed):
    calls = message.tool_calls or []
    check(f"{label}: made tool calls", len(calls) >= 1, message)
    for c in calls:
        check(f"{label}: call {c.function.name} is an allowed function", c.function.name in allowed, c)
        check(f"{label}: {c.function.name}'s arguments are valid JSON for its schema", valid(c.function.name, c.function.arguments), c.function.arguments)
        check(f"{label}: {c.function.name} has an id and type function", c.id.startswith("call_") and len(c.id) > 8 and c.type == "function", c)
    ids = [c.id for c in calls]
    check(f"{label}: call ids are unique", len(set(ids)) == len(ids), ids)


def check_finish(label, r, max_tokens):
    """Whatever the (random) model writes, its finish reason must agree with the answer: "tool_calls"
    with valid calls, "stop" with text and no call, "length" with exactly `max_tokens` tokens."""
    c = r.choices[0]
    m, finish, used = c.message, c.finish_reason, r.usage.completion_tokens
    check(f"{label}: a finish reason of the three", finish in ("stop", "length", "tool_calls"), r)
    if finish == "tool_calls":
        check_calls(label, m, {"get_weather", "get_time"})
    elif finish == "stop":
        check(f"{label}: stop: text and no calls", bool(m.content) and not m.tool_calls, r)
        check(f"{label}: stop: within max_tokens", 1 <= used <= max_tokens, r.usage)
    else:
        check(f"{label}: length: max_tokens ({max_tokens}) tokens", used == max_tokens, r.usage)
    print(f"     ({label}: finished with {finish} after {used} tokens)", flush=True)


def streamed_choices(client, **kw):
    """Per choice index: the calls, content and finish reason a stream adds up to (the client's
    deltas, by choice and by call index)."""
    out = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            calls, content, finish = out.setdefault(choice.index, ({}, "", None))
            d = choice.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    c["id"] = tc.id
                if tc.function and tc.function.name:
                    c["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    c["arguments"] += tc.function.arguments
            out[choice.index] = (calls, content, choice.finish_reason or finish)
    return {i: ([calls[k] for k in sorted(calls)], content, finish) for i, (calls, content, finish) in out.items()}


def streamed(client, **kw):
    """The calls, content and finish reason of a one-choice stream."""
    return streamed_choices(client, **kw)[0]


def with_tools(client, model):
    base = {"model": model, "messages": ASK, "tools": TOOLS, "max_tokens": 160, "temperature": 0}

    r = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **base)
    m = r.choices[0].message
    check_calls("required, one call", m, {"get_weather", "get_time"})
    check("required, one call: exactly one", len(m.tool_calls) == 1, m.tool_calls)
    check("required, one call: finish_reason tool_calls", r.choices[0].finish_reason == "tool_calls", r.choices[0].finish_reason)
    check("required, one call: no content besides the call", m.content is None, repr(m.content))

    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(tool_choice=named, **base)
    m = r.choices[0].message
    check_calls("named get_weather", m, {"get_weather"})
    check("named get_weather: one call", len(m.tool_calls) == 1, m.tool_calls)
    check("named get_weather: finish_reason tool_calls", r.choices[0].finish_reason == "tool_calls", r.choices[0].finish_reason)
    whole = calls_of(m)

    # The same greedy request, streamed: the deltas add up to the same calls.
    calls, content, finish = streamed(client, tool_choice=named, **base)
    check("streamed named: the same calls as without stream", [(c["name"], c["arguments"]) for c in calls] == whole, f"{calls} vs {whole}")
    check("streamed named: each call has its id", all(c["id"] and c["id"].startswith("call_") for c in calls), calls)
    check("streamed named: no content", content == "", repr(content))
    check("streamed named: finish_reason tool_calls", finish == "tool_calls", finish)

    # Several calls allowed (sampled): every complete call is valid, the stream agrees.
    sampled = dict(base, temperature=1.0, seed=11, max_tokens=200)
    r = client.chat.completions.create(tool_choice="required", **sampled)
    m = r.choices[0].message
    check_calls("required, parallel", m, {"get_weather", "get_time"})
    check("required, parallel: finish_reason tool_calls or length", r.choices[0].finish_reason in ("tool_calls", "length"), r.choices[0].finish_reason)
    calls, _, finish = streamed(client, tool_choice="required", **sampled)
    check("streamed required, parallel: the same calls", [(c["name"], c["arguments"]) for c in calls] == calls_of(m), f"{calls} vs {calls_of(m)}")
    check("streamed required, parallel: the same finish", finish == r.choices[0].finish_reason, finish)

    # n = 2: each choice is scanned for its own calls; with a seed, the stream agrees per choice.
    r = client.chat.completions.create(tool_choice="required", n=2, **sampled)
    check("n=2, required: two choices", sorted(c.index for c in r.choices) == [0, 1], r.choices)
    for c in r.choices:
        check_calls(f"n=2, required, choice {c.index}", c.message, {"get_weather", "get_time"})
    by_choice = streamed_choices(client, tool_choice="required", n=2, **sampled)
    for c in r.choices:
        calls, _, finish = by_choice.get(c.index, ([], "", None))
        check(f"streamed n=2, choice {c.index}: the same calls", [(x["name"], x["arguments"]) for x in calls] == calls_of(c.message), f"{calls} vs {calls_of(c.message)}")
        check(f"streamed n=2, choice {c.index}: the same finish", finish == c.finish_reason, finish)

    # auto: whatever the (random) model writes, a well-formed answer.
    r = client.chat.completions.create(tool_choice="auto", **dict(base, max_tokens=24))
    check_finish("auto", r, 24)

    # A conversation with an earlier call and its result.
    turn = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}},
        ]},
        {"role": "tool", "tool_call_id": "call_abc", "content": json.dumps({"temperature": 18})},
    ]
    r = client.chat.completions.create(model=model, messages=turn, tools=TOOLS, max_tokens=12, temperature=0)
    check_finish("multi-turn with a call and its result", r, 12)
    r = client.chat.completions.create(model=model, messages=turn, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=160, temperature=0)
    check_calls("multi-turn, required", r.choices[0].message, {"get_weather", "get_time"})

    # Refusals name their field.
    for label, kw, param in [
        ("a named function not in tools", {"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ("response_format with a forced call", {"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ("a tool that is not a function", {"tools": [{"type": "retrieval"}]}, "tools"),
        ("bad arguments in an earlier call", {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]}, "messages"),
    ]:
        try:
            client.chat.completions.create(**dict(base, **kw))
            check(f"{label}: refused", False, "answered 200")
        except openai.BadRequestError as e:
            check(f"{label}: a 400 naming {param}", e.param == param, f"param {e.param}: {e}")


def generic_format(client, model):
    """A template without tools (SmolLM2's): Ferry's generic format, tools in the prompt, the answer
    held by a grammar to a reply or calls."""
    base = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=160, temperature=0, extra_body={"repetition_penalty": 1.1})
    r = client.chat.completions.create(tool_choice="required", **base)
    check_calls("generic, required", r.choices[0].message, {"get_weather", "get_time"})
    check("generic, required: finish_reason tool_calls", r.choices[0].finish_reason == "tool_calls", r)
    r = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_time"}}, **base)
    check_calls("generic, named get_time", r.choices[0].message, {"get_time"})
    check("generic, named: one call", len(r.choices[0].message.tool_calls) == 1, r)
    # Streamed: the arguments come in pieces that add up to the whole answer's.
    whole = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **base)
    pieces = 0
    for chunk in client.chat.completions.create(stream=True, tool_choice="required", parallel_tool_calls=False, **base):
        for ch in chunk.choices:
            pieces += sum(1 for tc in ch.delta.tool_calls or [] if tc.function and tc.function.arguments)
    streamed = streamed_choices(client, tool_choice="required", parallel_tool_calls=False, **base)[0]
    check("generic, streamed: the same call as the whole answer", [(c["name"], c["arguments"]) for c in streamed[0]] == calls_of(whole.choices[0].message), (streamed, whole))
    check("generic, streamed: the arguments in several pieces", pieces > 2, pieces)
    # auto: the model picks, the answer is well formed either way.
    r = client.chat.completions.create(tool_choice="auto", **base)
    check_finish("generic, auto", r, 160)
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4, temperature=0)
    check("tool_choice none: plain chat", r.choices[0].message.content and not r.choices[0].message.tool_calls, r)


def main():
    a = json.loads(sys.argv[1])
    client = openai.OpenAI(base_url=a["base_url"], api_key=a["api_key"], max_retries=0, timeout=120)
    print(f"openai {openai.__version__} against {a['base_url']} ({a['model']}, takes tools: {a['takes_tools']})", flush=True)
    if a["takes_tools"]:
        with_tools(client, a["model"])
    else:
        generic_format(client, a["model"])
    print("all checks passed", flush=True)


if __name__ == "__main__":
    main()
