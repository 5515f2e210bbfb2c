"""Ferry's OpenAI-compatible HTTP API through the client libraries people use (pinned from PyPI).

Run against a running `ferry up`, with one JSON argument:
  base_url, api_key, model   where and how to connect (base_url ends in /v1)
  sections                   which sections to run (default: pydantic_ai, instructor, langchain):
                             "pydantic_ai", "instructor", "langchain", "responses", "auto"
                             (tool_choice "auto": only for a sensible model that takes tools), or
                             a function's name (e.g. "instructor_json_schema")
  responses                  true: run the "responses" section too (the `openai` client's
                             `responses.create`, against OpenAI's documented behaviour)
  extra_body                 vLLM sampling extensions sent with every request (default
                             {"repetition_penalty": 1.1}: the 135M model loops without it)
  max_tokens                 the bound of every request (default 400)
  random_weights             true: the model's weights are random (a tiny model given a tool template
                             for the forced-call checks): free text is not required to end by itself
  keep_going                 true: run every section, report each failure, fail at the end
Pins (one venv, Python 3.11; see docs/api.md "Client libraries"):
  openai==3.57.0 pydantic-ai-slim[openai]==2.62.0 langchain-openai==1.7.4, then
  instructor==1.17.0 with --no-deps (it pins jiter<0.15, every openai 3.x from 3.20 needs >=0.16).
Every call is greedy (temperature 0) and must give a valid object or tool call: results are
validated with strict pydantic models (no extra keys, no coercion), tool names and arguments
against their schemas, finish reasons checked. Prints one line per check; any failure raises
(non-zero exit), and an HTTP error's status and body are printed first.
"""

import asyncio
import json
import sys
from typing import Annotated, Literal

import openai
import pydantic
from pydantic import BaseModel, ConfigDict, Field

from openai_check import check


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class City(Strict):
    """A city and the country it lies in."""

    name: str = Field(min_length=1, max_length=24, description="The city's name.")
    country: str = Field(min_length=1, max_length=24, description="The country's name.")


class Weather(Strict):
    """A weather lookup: the city and the unit of degrees."""

    city: str = Field(min_length=1, max_length=16, description="The city's name.")
    unit: Literal["celsius", "fahrenheit"] = Field(description="Degrees.")


ASK_CITY = "What is the capital of France? Answer with the city and its country."
ASK_WEATHER = "What is the weather in Paris, in celsius?"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "The city's name.", "minLength": 1, "maxLength": 16},
                "unit": {"type": "string", "description": "Degrees.", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def weather_args(arguments):
    """The tool call's arguments (JSON text or a dict) validated against get_weather's schema."""
    if isinstance(arguments, str):
        return Weather.model_validate_json(arguments)
    return Weather.model_validate(arguments)


def valid_as(model, value):
    """Whether `value` (a model instance, dict or JSON text) is valid against `model`, strictly."""
    try:
        if isinstance(value, str):
            model.model_validate_json(value)
        else:
            model.model_validate(value.model_dump() if isinstance(value, BaseModel) else value)
        return True
    except pydantic.ValidationError:
        return False


def http_error_of(e):
    """The HTTP status and body behind a library's exception (walking its causes), or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, openai.APIStatusError):
            body = e.response.text if e.response is not None else e.body
            try:
                sent = e.request.content.decode()
            except Exception:
                sent = "?"
            return f"HTTP {e.status_code} on {e.request.method} {e.request.url}\n  body: {body}\n  sent: {sent}"
        if type(e).__name__ == "ModelHTTPError":  # pydantic-ai's
            return f"HTTP {e.status_code} (pydantic-ai ModelHTTPError)\n  body: {e.body}"
        e = e.__cause__ or e.__context__
    return None


# ---------------------------------------------------------------------------------------------
# pydantic-ai
# ---------------------------------------------------------------------------------------------


def pydantic_ai_model(a):
    import pydantic_ai
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIChatModelSettings
    from pydantic_ai.providers.openai import OpenAIProvider

    print(f"pydantic-ai {getattr(pydantic_ai, '__version__', '?')}", flush=True)
    client = openai.AsyncOpenAI(base_url=a["base_url"], api_key=a["api_key"], max_retries=0, timeout=600)
    model = OpenAIChatModel(a["model"], provider=OpenAIProvider(openai_client=client))
    return model, OpenAIChatModelSettings(temperature=0, max_tokens=a["max_tokens"], extra_body=a["extra_body"])


def pydantic_ai_output(a):
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, ToolCallPart

    model, settings = pydantic_ai_model(a)
    # output_type with its default: a `final_result` output tool the model must call (no text output).
    agent = Agent(model, output_type=City, model_settings=settings, retries=0)
    r = agent.run_sync(ASK_CITY)
    check("pydantic-ai output_type: a strict City", isinstance(r.output, City) and valid_as(City, r.output), r.output)
    calls = [p for m in r.all_messages() if isinstance(m, ModelResponse) for p in m.parts if isinstance(p, ToolCallPart)]
    # `tool_choice` required allows parallel calls: pydantic-ai takes the first output call.
    check("pydantic-ai output_type: by calls of its output tool, each a strict City", len(calls) >= 1 and all(c.tool_name == "final_result" and valid_as(City, c.args_as_dict()) for c in calls), calls)
    last = [m for m in r.all_messages() if isinstance(m, ModelResponse)][-1]
    check("pydantic-ai output_type: finish_reason tool_call", last.finish_reason == "tool_call", last.finish_reason)

    # Streamed (tool-call deltas): the same City as the whole greedy answer (a fresh agent: the
    # first one's async client belongs to run_sync's event loop).
    model, settings = pydantic_ai_model(a)
    agent = Agent(model, output_type=City, model_settings=settings, retries=0)

    async def streamed():
        async with agent.run_stream(ASK_CITY) as result:
            partial = [o async for o in result.stream_output(debounce_by=None)]
            return partial, await result.get_output()

    partial, final = asyncio.run(streamed())
    check("pydantic-ai run_stream: a strict City", isinstance(final, City) and valid_as(City, final), final)
    check("pydantic-ai run_stream: equals the whole answer", final == r.output, (final, r.output))
    check("pydantic-ai run_stream: partial outputs along the way", len(partial) >= 1, partial)


def pydantic_ai_native(a):
    """NativeOutput: the City schema as response_format json_schema (no tools; SmolLM2 takes it today)."""
    from pydantic_ai import Agent, NativeOutput

    model, settings = pydantic_ai_model(a)
    r = Agent(model, output_type=NativeOutput(City), model_settings=settings, retries=0).run_sync(ASK_CITY)
    check("pydantic-ai NativeOutput: a strict City", isinstance(r.output, City) and valid_as(City, r.output), r.output)
    last = r.all_messages()[-1]
    check("pydantic-ai NativeOutput: finish_reason stop", last.finish_reason == "stop", last)

def pydantic_ai_tool(a):
    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart

    model, settings = pydantic_ai_model(a)
    # One tool, forced on the first step (tool_choice "required"), then "none": the agent runs it
    # and the model answers in text. A static "required" is refused by pydantic-ai (it would loop),
    # so it varies per step through a capability, as its docs say.
    class ForceToolFirst(AbstractCapability):
        def get_model_settings(self):
            return lambda ctx: {"tool_choice": "required" if ctx.run_step <= 1 else "none"}

    seen = []
    tool_agent = Agent(model, model_settings=settings, retries=0, capabilities=[ForceToolFirst()])

    @tool_agent.tool_plain
    def get_weather(city: Annotated[str, Field(min_length=1, max_length=16)], unit: Literal["celsius", "fahrenheit"]) -> str:
        """The current weather in a city.

        Args:
            city: The city's name.
            unit: Degrees.
        """
        seen.append(weather_args({"city": city, "unit": unit}))
        return f"Sunny, 21 degrees {unit}."

    r = tool_agent.run_sync(ASK_WEATHER)
    msgs = r.all_messages()
    responses = [m for m in msgs if isinstance(m, ModelResponse)]
    calls = [p for m in responses for p in m.parts if isinstance(p, ToolCallPart)]
    check("pydantic-ai forced tool: exactly one call, of get_weather", [c.tool_name for c in calls] == ["get_weather"], calls)
    check("pydantic-ai forced tool: arguments valid against its schema", valid_as(Weather, calls[0].args_as_dict()) and len(seen) == 1, calls[0].args)
    check("pydantic-ai forced tool: first response finish_reason tool_call", responses[0].finish_reason == "tool_call", responses[0])
    returns = [p for m in msgs for p in getattr(m, "parts", []) if isinstance(p, ToolReturnPart)]
    check("pydantic-ai forced tool: the tool's result went back", len(returns) == 1 and "Sunny" in str(returns[0].content), returns)
    check("pydantic-ai forced tool: then a text answer", isinstance(r.output, str) and r.output.strip() != "", r.output)
    check("pydantic-ai forced tool: two model requests, the last a text answer", len(responses) == 2 and any(isinstance(p, TextPart) for p in responses[-1].parts), responses)
    if not a.get("random_weights"):
        check("pydantic-ai forced tool: the answer ends with finish_reason stop", responses[-1].finish_reason == "stop", responses[-1])


# ---------------------------------------------------------------------------------------------
# instructor
# ---------------------------------------------------------------------------------------------


def instructor_tools(a):
    instructor_mode(a, "TOOLS")


def instructor_json_schema(a):
    instructor_mode(a, "JSON_SCHEMA")


def instructor_mode(a, name):
    import instructor

    print(f"instructor {instructor.__version__}", flush=True)
    base = openai.OpenAI(base_url=a["base_url"], api_key=a["api_key"], max_retries=0, timeout=600)
    kw = dict(model=a["model"], temperature=0, max_tokens=a["max_tokens"], extra_body=a["extra_body"], max_retries=1)
    for mode in [getattr(instructor.Mode, name)]:
        client = instructor.from_openai(base, mode=mode)
        obj, completion = client.chat.completions.create_with_completion(
            response_model=City, messages=[{"role": "user", "content": ASK_CITY}], **kw
        )
        check(f"instructor {name}: a strict City", isinstance(obj, City) and valid_as(City, obj), obj)
        choice = completion.choices[0]
        if name == "TOOLS":
            calls = choice.message.tool_calls or []
            check(f"instructor {name}: one call of the City tool", [c.function.name for c in calls] == ["City"], calls)
            check(f"instructor {name}: its arguments parse strictly", valid_as(City, calls[0].function.arguments), calls[0].function.arguments)
            # A named tool_choice: OpenAI answers "stop"; Ferry "tool_calls" for any call (docs/api.md).
            check(f"instructor {name}: finish_reason tool_calls", choice.finish_reason == "tool_calls", choice.finish_reason)
        else:
            check(f"instructor {name}: the content parses strictly", valid_as(City, choice.message.content), choice.message.content)
            check(f"instructor {name}: finish_reason stop", choice.finish_reason == "stop", choice.finish_reason)


# ---------------------------------------------------------------------------------------------
# langchain-openai
# ---------------------------------------------------------------------------------------------


def langchain_llm(a):
    import langchain_openai
    from langchain_openai import ChatOpenAI

    print(f"langchain-openai {getattr(langchain_openai, '__version__', '?')}", flush=True)
    llm = ChatOpenAI(
        model=a["model"],
        base_url=a["base_url"],
        api_key=a["api_key"],
        temperature=0,
        max_tokens=a["max_tokens"],
        max_retries=0,
        timeout=600,
        extra_body=a["extra_body"],
    )
    return llm


def langchain_tools(a):
    from langchain_core.messages import AIMessage, HumanMessage

    llm = langchain_llm(a)
    for choice in ["required", "get_weather"]:
        bound = llm.bind_tools([WEATHER_TOOL], tool_choice=choice)
        m = bound.invoke([HumanMessage(ASK_WEATHER)])
        check(f"langchain bind_tools tool_choice={choice}: an AIMessage", isinstance(m, AIMessage), m)
        calls = m.tool_calls
        check(f"langchain bind_tools tool_choice={choice}: calls get_weather", len(calls) >= 1 and {c["name"] for c in calls} == {"get_weather"}, m)
        check(f"langchain bind_tools tool_choice={choice}: arguments valid", all(valid_as(Weather, c["args"]) for c in calls), calls)
        check(f"langchain bind_tools tool_choice={choice}: none invalid", not m.invalid_tool_calls, m.invalid_tool_calls)
        fin = m.response_metadata.get("finish_reason")
        check(f"langchain bind_tools tool_choice={choice}: finish_reason tool_calls", fin == "tool_calls", fin)

    # Streamed: the chunks add up to the same calls.
    acc = None
    for chunk in llm.bind_tools([WEATHER_TOOL], tool_choice="required").stream([HumanMessage(ASK_WEATHER)]):
        acc = chunk if acc is None else acc + chunk
    check("langchain bind_tools streamed: calls get_weather with valid arguments", acc is not None and [c["name"] for c in acc.tool_calls][:1] == ["get_weather"] and all(valid_as(Weather, c["args"]) for c in acc.tool_calls), acc)



def langchain_structured(a):
    from langchain_core.messages import HumanMessage

    llm = langchain_llm(a)
    structured = llm.with_structured_output(City, method="function_calling", include_raw=True)
    out = structured.invoke([HumanMessage(ASK_CITY)])
    check("langchain with_structured_output(function_calling): no parsing error", out["parsing_error"] is None, out)
    check("langchain with_structured_output(function_calling): a strict City", isinstance(out["parsed"], City) and valid_as(City, out["parsed"]), out["parsed"])
    calls = out["raw"].tool_calls
    check("langchain with_structured_output(function_calling): by a call of the City tool", [c["name"] for c in calls] == ["City"], calls)
    check("langchain with_structured_output(function_calling): finish_reason tool_calls", out["raw"].response_metadata.get("finish_reason") == "tool_calls", out["raw"])


def langchain_json_schema(a):
    """with_structured_output's default method, json_schema (response_format; no tools)."""
    from langchain_core.messages import HumanMessage

    out = langchain_llm(a).with_structured_output(City, method="json_schema", include_raw=True).invoke([HumanMessage(ASK_CITY)])
    check("langchain with_structured_output(json_schema): no parsing error", out["parsing_error"] is None, out)
    check("langchain with_structured_output(json_schema): a strict City", isinstance(out["parsed"], City) and valid_as(City, out["parsed"]), out["parsed"])
    check("langchain with_structured_output(json_schema): finish_reason stop", out["raw"].response_metadata.get("finish_reason") == "stop", out["raw"])

def auto_section(a):
    """tool_choice "auto" (the libraries' default with tools): whatever the model picks, each answer
    is a valid call or text. Only a sensible model with tools (SmolLM2 once Ferry renders tools for
    templates without them) makes this meaningful; not in the default sections."""
    from langchain_core.messages import HumanMessage
    from pydantic_ai import Agent, UsageLimits
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart

    m = langchain_llm(a).bind_tools([WEATHER_TOOL]).invoke([HumanMessage(ASK_WEATHER)])
    fin = m.response_metadata.get("finish_reason")
    if m.tool_calls:
        check("langchain auto: valid get_weather calls, finish_reason tool_calls", all(c["name"] == "get_weather" and valid_as(Weather, c["args"]) for c in m.tool_calls) and not m.invalid_tool_calls and fin == "tool_calls", m)
    else:
        check("langchain auto: a text answer, finish_reason stop", isinstance(m.content, str) and m.content.strip() != "" and not m.invalid_tool_calls and fin == "stop", m)

    model, settings = pydantic_ai_model(a)
    agent = Agent(model, model_settings=settings, retries=0)

    @agent.tool_plain
    def get_weather(city: Annotated[str, Field(min_length=1, max_length=16)], unit: Literal["celsius", "fahrenheit"]) -> str:
        """The current weather in a city.

        Args:
            city: The city's name.
            unit: Degrees.
        """
        return f"Sunny, 21 degrees {unit}."

    r = agent.run_sync(ASK_WEATHER, usage_limits=UsageLimits(request_limit=4))
    responses = [x for x in r.all_messages() if isinstance(x, ModelResponse)]
    calls = [p for x in responses for p in x.parts if isinstance(p, ToolCallPart)]
    check("pydantic-ai auto: every call valid", all(c.tool_name == "get_weather" and valid_as(Weather, c.args_as_dict()) for c in calls), calls)
    check("pydantic-ai auto: ends in a text answer, finish_reason stop", isinstance(r.output, str) and r.output.strip() != "" and responses[-1].finish_reason == "stop" and any(isinstance(p, TextPart) for p in responses[-1].parts), responses[-1])


# ---------------------------------------------------------------------------------------------
# openai: responses.create
# ---------------------------------------------------------------------------------------------


def responses_client(a):
    client = openai.OpenAI(base_url=a["base_url"], api_key=a["api_key"], max_retries=0, timeout=600)
    return client, dict(model=a["model"], temperature=0, max_output_tokens=a["max_tokens"], extra_body=a["extra_body"])


def responses_text(a):
    client, kw = responses_client(a)
    # Plain.
    r = client.responses.create(input="What is the capital of France?", **kw)
    check("responses: object response, status completed", r.object == "response" and r.status == "completed", r)
    check("responses: an id and the model", bool(r.id) and r.model == a["model"], (r.id, r.model))
    msgs = [o for o in r.output if o.type == "message"]
    check("responses: one assistant message of output_text", len(msgs) == 1 and msgs[0].role == "assistant" and all(c.type == "output_text" for c in msgs[0].content), r.output)
    check("responses: output_text non-empty", r.output_text.strip() != "", r.output_text)
    u = r.usage
    check("responses: usage", u is not None and u.input_tokens > 0 and 0 < u.output_tokens <= a["max_tokens"] and u.total_tokens == u.input_tokens + u.output_tokens, u)

    # Streamed: the documented event sequence, and deltas that add up to the whole answer.
    events, text, final = [], "", None
    for ev in client.responses.create(input="What is the capital of France?", stream=True, **kw):
        events.append(ev.type)
        if ev.type == "response.output_text.delta":
            text += ev.delta
        if ev.type == "response.completed":
            final = ev.response
    check("responses streamed: starts with response.created", events[:1] == ["response.created"], events[:5])
    check("responses streamed: ends with response.completed", events[-1:] == ["response.completed"] and final is not None, events[-5:])
    check("responses streamed: has the item/part/text events", {"response.output_item.added", "response.content_part.added", "response.output_text.delta", "response.output_text.done", "response.output_item.done"} <= set(events), sorted(set(events)))
    check("responses streamed: deltas add up to the final text", text == final.output_text and text != "", (text, final.output_text))
    check("responses streamed: equals the whole (greedy) answer", text == r.output_text, (text, r.output_text))



def responses_json_schema(a):
    client, kw = responses_client(a)
    # Structured: text.format json_schema (strict), by hand and through responses.parse.
    schema = City.model_json_schema()
    r = client.responses.create(
        input=ASK_CITY, text={"format": {"type": "json_schema", "name": "City", "schema": schema, "strict": True}}, **kw
    )
    check("responses json_schema: status completed", r.status == "completed", r)
    check("responses json_schema: output_text is a strict City", valid_as(City, r.output_text), r.output_text)
    p = client.responses.parse(input=ASK_CITY, text_format=City, **kw)
    check("responses.parse(text_format=City): a strict City", isinstance(p.output_parsed, City) and valid_as(City, p.output_parsed), p.output_parsed)



def responses_tools(a):
    client, kw = responses_client(a)
    # A function tool, forced; then its output goes back and the model answers.
    tool = {"type": "function", "name": "get_weather", "description": WEATHER_TOOL["function"]["description"], "parameters": WEATHER_TOOL["function"]["parameters"], "strict": True}
    r = client.responses.create(input=ASK_WEATHER, tools=[tool], tool_choice="required", **kw)
    calls = [o for o in r.output if o.type == "function_call"]
    check("responses tool required: a function_call of get_weather", len(calls) >= 1 and all(c.name == "get_weather" for c in calls), r.output)
    check("responses tool required: arguments valid", all(valid_as(Weather, c.arguments) for c in calls), [c.arguments for c in calls])
    check("responses tool required: a call_id", all(c.call_id for c in calls), calls)
    r = client.responses.create(input=ASK_WEATHER, tools=[tool], tool_choice={"type": "function", "name": "get_weather"}, **kw)
    calls2 = [o for o in r.output if o.type == "function_call"]
    check("responses tool named: one valid get_weather call", len(calls2) == 1 and calls2[0].name == "get_weather" and valid_as(Weather, calls2[0].arguments), r.output)

    # Streamed tool call: the arguments arrive as deltas that add up to the done item's.
    args, done = "", None
    for ev in client.responses.create(input=ASK_WEATHER, tools=[tool], tool_choice="required", stream=True, **kw):
        if ev.type == "response.function_call_arguments.delta":
            args += ev.delta
        if ev.type == "response.output_item.done" and ev.item.type == "function_call":
            done = done or ev.item
    check("responses tool streamed: argument deltas add up to the call", done is not None and args == done.arguments and valid_as(Weather, args), (args, done))

    follow = [
        {"role": "user", "content": ASK_WEATHER},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 degrees celsius."},
    ]
    r = client.responses.create(input=follow, tools=[tool], tool_choice="none", **kw)
    check("responses tool output: then a text answer", r.status == "completed" and r.output_text.strip() != "" and not [o for o in r.output if o.type == "function_call"], r.output)


SECTIONS = {
    f.__name__: f
    for f in [
        pydantic_ai_output,
        pydantic_ai_native,
        pydantic_ai_tool,
        instructor_tools,
        instructor_json_schema,
        langchain_tools,
        langchain_structured,
        langchain_json_schema,
        auto_section,
        responses_text,
        responses_json_schema,
        responses_tools,
    ]
}
GROUPS = {
    "pydantic_ai": ["pydantic_ai_output", "pydantic_ai_native", "pydantic_ai_tool"],
    "instructor": ["instructor_tools", "instructor_json_schema"],
    "langchain": ["langchain_tools", "langchain_structured", "langchain_json_schema"],
    "responses": ["responses_text", "responses_json_schema", "responses_tools"],
    "auto": ["auto_section"],
}


def main():
    a = json.loads(sys.argv[1])
    a.setdefault("extra_body", {"repetition_penalty": 1.1})
    a.setdefault("max_tokens", 400)
    names = a.get("sections", ["pydantic_ai", "instructor", "langchain"]) + (["responses"] if a.get("responses") else [])
    names = list(dict.fromkeys(n for g in names for n in GROUPS.get(g, [g])))
    print(f"openai {openai.__version__}, pydantic {pydantic.VERSION} against {a['base_url']}: {', '.join(names)}", flush=True)
    failed = []
    for name in names:
        try:
            SECTIONS[name](a)
        except Exception as e:
            if not a.get("keep_going"):
                why = http_error_of(e)
                if why:
                    print(f"FAIL {name}: {why}", flush=True)
                raise
            failed.append(name)
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:2000]}\n  {http_error_of(e) or ''}", flush=True)
    if failed:
        raise SystemExit(f"failed sections: {', '.join(failed)}")
    print("all checks passed", flush=True)


if __name__ == "__main__":
    main()
