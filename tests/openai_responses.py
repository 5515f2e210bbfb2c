"""The Responses API (`POST /v1/responses`, stateless) through the official `openai` Python client.

Run against a running `ferry up`, with one JSON argument:
  base_url, api_key, model   where and how to connect (base_url ends in /v1)
  takes_tools                true: the model's chat template takes tools (a tiny random model given
                             vLLM's Hermes template, tests/fixtures/tools: only the tool checks
                             run, its text being random); false or absent: it takes none
                             (SmolLM2's ChatML template: Ferry's generic tool format) and every
                             check runs
Checks: a plain text answer (`output_text`, usage, the echoed request fields); `instructions` and a
message list; a stream's events in OpenAI's order, numbered, whose deltas add up to the final
response and to the same greedy request without `stream` (and the client's `responses.stream`
helper agrees); `text.format` json_schema through `responses.parse` with a pydantic model;
`max_output_tokens` cutting an answer (`incomplete`); a forced call (`tool_choice` required and
named) whose arguments validate against the function's schema, streamed to the same call, and a
follow-up turn sending the `function_call` and its `function_call_output` back; and the
stateless refusals: `store: true`, `previous_response_id`, built-in tools, each a 400 naming its
field; and every field of the package's `ResponseCreateParamsBase` is in docs/api.md's field table
(endpoint `responses`) and judged by it, as tests/openai_fields.py does for chat and completions
(supported: answered; rejected or limited: a 400 naming it, and a limited one's allowed value
answered). Every request is bounded by a small `max_output_tokens`. Prints one line per
check; any failure raises (non-zero exit).
"""

import json
import pathlib
import sys
import typing

import openai
import pydantic
from openai.types.responses import response_create_params

from openai_check import check
from openai_fields import sample_of_type, table

API_MD = pathlib.Path(__file__).resolve().parent.parent / "docs" / "api.md"

WEATHER = {
    "type": "function",
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
    "strict": True,
}
ASK = "What is the weather in Paris, in celsius?"


class Verdict(pydantic.BaseModel):
    answer: typing.Literal["yes", "no"]
    sure: bool


def valid_weather(arguments):
    """Whether `arguments` (JSON text) is valid against get_weather's schema."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return False
    props = WEATHER["parameters"]["properties"]
    return (
        isinstance(args, dict)
        and set(args) == {"city", "unit"}
        and isinstance(args["city"], str)
        and len(args["city"]) <= props["city"]["maxLength"]
        and args["unit"] in props["unit"]["enum"]
    )


# The events a stream may hold, and the order a message's and a call's events come in.
MESSAGE_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta*",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
CALL_EVENTS = [
    "response.output_item.added",
    "response.function_call_arguments.delta*",
    "response.function_call_arguments.done",
    "response.output_item.done",
]


def shape(types):
    """The event types with runs of deltas folded into one `…delta*`."""
    out = []
    for t in types:
        t = t + "*" if t.endswith(".delta") else t
        if not (out and out[-1] == t and t.endswith("*")):
            out.append(t)
    return out


def replay(label, events):
    """Checks a stream's order and numbering, and gives back the final response and the output
    its events add up to: per item, its type and text or arguments."""
    types = [e.type for e in events]
    check(f"{label}: starts with created, in_progress", types[:2] == ["response.created", "response.in_progress"], types[:4])
    check(f"{label}: ends with completed or incomplete", types[-1] in ("response.completed", "response.incomplete"), types[-3:])
    check(f"{label}: sequence numbers count from 0", [e.sequence_number for e in events] == list(range(len(events))), [e.sequence_number for e in events][:8])
    body, items = shape(types[2:-1]), []
    while body:
        item = next(e for e in events if e.type == "response.output_item.added" and e.output_index == len(items)).item
        want = MESSAGE_EVENTS if item.type == "message" else CALL_EVENTS
        # A message's or call's deltas may be none (an empty text); allow the run to be absent.
        got = body[: len(want)]
        if got != want:
            want = [w for w in want if not w.endswith("*")]
            got = body[: len(want)]
        check(f"{label}: item {len(items)} ({item.type}) in OpenAI's order", got == want, f"{got} vs {want}")
        body = body[len(want):]
        items.append(item.type)
    added = []
    for i, kind in enumerate(items):
        if kind == "message":
            text = "".join(e.delta for e in events if e.type == "response.output_text.delta" and e.output_index == i)
            done = next(e for e in events if e.type == "response.output_text.done" and e.output_index == i)
            check(f"{label}: item {i}'s deltas add up to its output_text.done", text == done.text, f"{text!r} vs {done.text!r}")
            added.append(("message", text))
        else:
            args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.output_index == i)
            done = next(e for e in events if e.type == "response.function_call_arguments.done" and e.output_index == i)
            check(f"{label}: item {i}'s argument deltas add up to arguments.done", args == done.arguments, f"{args!r} vs {done.arguments!r}")
            added.append(("function_call", args))
    return events[-1].response, added


def output_of(r):
    """A response's output: per item, its type and text or arguments."""
    out = []
    for item in r.output:
        if item.type == "message":
            out.append(("message", "".join(c.text for c in item.content)))
        else:
            out.append(("function_call", item.arguments))
    return out


def refused(label, param, create, **kw):
    try:
        create(**kw)
        check(f"{label}: refused", False, "answered 200")
    except openai.BadRequestError as e:
        check(f"{label}: a 400 naming {param}", e.param == param, f"param {e.param}: {e}")
        return str(e)
    return ""


def text(client, model):
    base = {"model": model, "max_output_tokens": 12, "temperature": 0}
    r = client.responses.create(input="Say hello.", **base)
    check("plain: a response object", r.object == "response" and r.id.startswith("resp_"), r)
    check("plain: completed or cut at max_output_tokens", r.status == "completed" or (r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"), r.status)
    check("plain: one assistant message with text", len(r.output) == 1 and r.output[0].type == "message" and r.output[0].role == "assistant", r.output)
    check("plain: output_text is its text", r.output_text == r.output[0].content[0].text and r.output_text, repr(r.output_text))
    check("plain: message id msg_", r.output[0].id.startswith("msg_"), r.output[0].id)
    u = r.usage
    check("plain: usage adds up", u.total_tokens == u.input_tokens + u.output_tokens and 1 <= u.output_tokens <= 12, u)
    check("plain: usage details", u.input_tokens_details.cached_tokens >= 0 and u.output_tokens_details.reasoning_tokens == 0, u)
    check("plain: echoes the request", r.max_output_tokens == 12 and r.temperature == 0 and r.store is False and r.tools == [] and r.tool_choice == "auto", r)

    r = client.responses.create(input=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": [{"type": "input_text", "text": "Say yes."}]}], instructions="Answer in one word.", **base)
    check("instructions and a message list: answered", r.status in ("completed", "incomplete") and r.output_text, r)
    check("instructions: echoed", r.instructions == "Answer in one word.", r.instructions)

    r = client.responses.create(input="Count from one to twenty in words.", **dict(base, max_output_tokens=3))
    check("max_output_tokens 3: incomplete, reason max_output_tokens", r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens", r)
    check("max_output_tokens 3: 3 tokens", r.usage.output_tokens == 3, r.usage)
    check("max_output_tokens 3: the message is incomplete", r.output[0].status == "incomplete", r.output[0])

    # Streamed: in order, numbered, adding up to the final response and to the whole answer.
    whole = client.responses.create(input="Tell me about Paris.", **base)
    events = list(client.responses.create(input="Tell me about Paris.", stream=True, **base))
    final, added = replay("streamed text", events)
    check("streamed text: the deltas add up to the final response", added == output_of(final), f"{added} vs {output_of(final)}")
    check("streamed text: the same as without stream", output_of(final) == output_of(whole), f"{output_of(final)} vs {output_of(whole)}")
    check("streamed text: the same status and usage", (final.status, final.usage.output_tokens) == (whole.status, whole.usage.output_tokens), final)

    # Structured: a strict json_schema through the client's parse helper, whole and streamed (the
    # schema ends the answer, so it completes: the stream helper wants `response.completed`).
    structured = dict(base, input="Is Paris in France? Answer as JSON.", max_output_tokens=40)
    r = client.responses.parse(text_format=Verdict, **structured)
    check("text.format json_schema: completed", r.status == "completed", r)
    check("text.format json_schema: parsed into the pydantic model", isinstance(r.output_parsed, Verdict), r.output_text)
    check("text.format json_schema: echoed", r.text.format.type == "json_schema" and r.text.format.strict, r.text)
    with client.responses.stream(text_format=Verdict, **structured) as s:
        deltas = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        helper = s.get_final_response()
    check("responses.stream helper: get_final_response agrees", helper.output_text == deltas == r.output_text, f"{helper.output_text!r} / {deltas!r} / {r.output_text!r}")
    check("responses.stream helper: parsed the same", helper.output_parsed == r.output_parsed, helper.output_parsed)
    r = client.responses.create(input="Give me a JSON object.", text={"format": {"type": "json_object"}}, **dict(base, max_output_tokens=40))
    if r.status == "completed":
        check("text.format json_object: a JSON object", isinstance(json.loads(r.output_text), dict), r.output_text)


def with_tools(client, model):
    base = {"model": model, "input": ASK, "tools": [WEATHER], "max_output_tokens": 160, "temperature": 0}
    r = client.responses.create(tool_choice="required", parallel_tool_calls=False, **base)
    calls = [o for o in r.output if o.type == "function_call"]
    check("required: one function_call item", len(calls) == 1, r.output)
    c = calls[0]
    check("required: get_weather with arguments valid for its schema", c.name == "get_weather" and valid_weather(c.arguments), c)
    check("required: ids call_ and fc_", c.call_id.startswith("call_") and c.id.startswith("fc_") and c.status == "completed", c)
    check("required: completed", r.status == "completed", r.status)

    named = {"type": "function", "name": "get_weather"}
    whole = client.responses.create(tool_choice=named, **base)
    check("named: one valid call", [o.name for o in whole.output if o.type == "function_call"] == ["get_weather"], whole.output)
    events = list(client.responses.create(tool_choice=named, stream=True, **base))
    final, added = replay("streamed named call", events)
    check("streamed named call: the deltas add up to the final response", added == output_of(final), f"{added} vs {output_of(final)}")
    check("streamed named call: the same call as without stream", output_of(final) == output_of(whole), f"{output_of(final)} vs {output_of(whole)}")

    # The next turn: the call and its output go back as input items.
    turn = [
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments},
        {"type": "function_call_output", "call_id": c.call_id, "output": json.dumps({"temperature": 18})},
    ]
    r = client.responses.create(**dict(base, input=turn, max_output_tokens=12))
    check("a turn with a call and its output: answered", r.status in ("completed", "incomplete"), r)
    r = client.responses.create(**dict(base, input=[*turn, *[o.model_dump(exclude_none=True) for o in whole.output]], max_output_tokens=12))
    check("an earlier response's output items sent back: answered", r.status in ("completed", "incomplete"), r)
    refused("a named function not in tools", "tool_choice", client.responses.create, **dict(base, tool_choice={"type": "function", "name": "nope"}))
    r = client.responses.create(**dict(base, tool_choice="none", max_output_tokens=4))
    check("tool_choice none: a message, no calls", [o.type for o in r.output] == ["message"], r.output)




def refusals(client, model):
    base = {"model": model, "input": "Hi", "max_output_tokens": 4}
    m = refused("store: true", "store", client.responses.create, store=True, **base)
    check("store: true: says Ferry stores no responses", "Ferry stores no responses; send store: false" in m, m)
    refused("previous_response_id", "previous_response_id", client.responses.create, previous_response_id="resp_123", **base)
    refused("a built-in tool", "tools", client.responses.create, tools=[{"type": "web_search"}], **base)
    refused("reasoning effort high", "reasoning", client.responses.create, reasoning={"effort": "high"}, **base)
    refused("an input image", "input[0].content[0].type", client.responses.create, **dict(base, input=[{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}]))
    r = client.responses.create(store=False, **base)
    check("store: false: answered", r.store is False and r.status in ("completed", "incomplete"), r)


# A representative non-default value per request field; for a limited field, one outside the values
# docs/api.md allows (ALLOWED has one inside them). Fields not here get `sample_of_type`'s.
SAMPLES = {
    "instructions": "Be brief.",
    "max_output_tokens": 2,
    "temperature": 0.7,
    "top_p": 0.9,
    "text": {"format": {"type": "json_object"}},
    "tools": [WEATHER],
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "stream_options": {"include_obfuscation": True},
    "store": True,
    "max_tool_calls": 0,
    "reasoning": {"effort": "high"},
    "include": ["message.output_text.logprobs"],
    "top_logprobs": 2,
    "truncation": "auto",
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "explicit"},
    "service_tier": "flex",
    "metadata": {"team": "ferry"},
    "user": "user-1",
    "safety_identifier": "user-hash-1",
    "prompt_cache_key": "conversation-1",
    "previous_response_id": "resp_123",
    "conversation": "conv_123",
    "background": True,
    "prompt": {"id": "pmpt_123"},
    "context_management": [{"type": "compaction"}],
    "moderation": {"model": "omni-moderation-latest"},
}
ALLOWED = {
    "stream_options": {},
    "store": False,
    "max_tool_calls": 1,
    "reasoning": {},
    "include": [],
    "top_logprobs": 0,
    "truncation": "disabled",
    "prompt_cache_retention": "in_memory",
    "prompt_cache_options": {},
    "service_tier": "auto",
}
# Limited to logging: any value of the type is answered.
LOGGED = {"user", "metadata", "safety_identifier", "prompt_cache_key"}
COMPANIONS = {"tool_choice": {"tools": [WEATHER]}}


def fields(client, model):
    """Every field of the `openai` package's Responses request type is in docs/api.md's table
    (endpoint `responses`), and a request with its sample is judged by the table."""
    documented = table(API_MD)

    def send(extra):
        body = {"model": model, "input": "Hi", "max_output_tokens": 2, **extra}
        if "stream_options" in extra:
            body["stream"] = True
        try:
            r = client.responses.create(**body)
            if body.get("stream"):
                list(r)
            return 200, "", None
        except openai.APIStatusError as e:
            return e.status_code, str(e), getattr(e, "param", None)

    hints = typing.get_type_hints(response_create_params.ResponseCreateParamsBase)
    check("responses: the schema has fields", len(hints) > 20, list(hints))
    for field, tp in hints.items():
        support = documented.get((field, "responses"))
        check(f"responses.{field} is in docs/api.md's table", support is not None, "add it to fields.rs and docs/api.md")
        if field in ("model", "input"):
            continue
        value = SAMPLES[field] if field in SAMPLES else sample_of_type(tp)
        status, message, param = send({field: value, **COMPANIONS.get(field, {})})
        label = f"responses.{field} = {json.dumps(value)[:40]}"
        if support == "supported" or field in LOGGED:
            check(f"{label}: {support}, answered", status == 200, f"{status} {message}")
        else:
            check(f"{label}: {support}, a 400 naming it", status == 400 and param == field, f"{status} {message} (param {param})")
        if support == "limited" and field not in LOGGED:
            check(f"{label}: ALLOWED has a value it allows", field in ALLOWED, "add one from docs/api.md's row")
            status, message, _ = send({field: ALLOWED[field]})
            check(f"responses.{field} = {json.dumps(ALLOWED[field])}: allowed, answered", status == 200, f"{status} {message}")
    status, message, param = send({"extra_body": {"temprature": 0.1}})
    check("responses: an unknown field is a 400 naming it", status == 400 and param == "temprature", message)


def main():
    a = json.loads(sys.argv[1])
    client = openai.OpenAI(base_url=a["base_url"], api_key=a["api_key"], max_retries=0, timeout=120)
    print(f"openai {openai.__version__} against {a['base_url']} ({a['model']}, takes tools: {a.get('takes_tools', False)})", flush=True)
    refusals(client, a["model"])
    fields(client, a["model"])
    if not a.get("takes_tools"):
        text(client, a["model"])
    with_tools(client, a["model"])
    print("all checks passed", flush=True)


if __name__ == "__main__":
    main()
