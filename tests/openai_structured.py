"""Structured outputs through the official `openai` Python client's `chat.completions.parse`.

Run by tests/cluster.rs against a running `ferry up` (the default model, SmolLM2-135M-Instruct),
with one JSON argument: base_url, api_key, model. For each pydantic model below (nested objects,
enums, arrays, numbers, optional fields), greedy and sampled, the client sends the model's strict
JSON schema as `response_format` and parses the answer with pydantic: every answer must validate.
Then `response_format` json_object, and a bad schema (a 400 naming `response_format`).
Prints one line per check; any failure raises (non-zero exit).
"""

import enum
import json
import sys
from typing import Literal, Optional

import openai
import pydantic
from pydantic import BaseModel, Field

from openai_check import check


class Address(BaseModel):
    city: str = Field(max_length=24)
    country: str = Field(max_length=24)


class Person(BaseModel):
    """Nested objects."""

    name: str = Field(max_length=32)
    age: int = Field(ge=0, le=150)
    home: Address


class Color(str, enum.Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Paint(BaseModel):
    """Enums and booleans."""

    color: Color
    finish: Literal["matte", "gloss"]
    washable: bool


class Groceries(BaseModel):
    """Arrays."""

    items: list[str] = Field(max_length=5)
    quantities: list[int] = Field(max_length=5)


class Measurement(BaseModel):
    """Numbers."""

    value: float
    tolerance: float = Field(ge=0, le=1)
    count: int


class Event(BaseModel):
    """Optional fields."""

    title: str = Field(max_length=40)
    location: Optional[str] = Field(default=None, max_length=40)
    attendees: Optional[int] = None


CASES = [
    (Person, "Describe a person who lives in Paris as JSON."),
    (Paint, "Pick a paint for a kitchen wall, as JSON."),
    (Groceries, "List what to buy for pancakes, as JSON."),
    (Measurement, "Give the length of a pencil in centimeters with its tolerance, as JSON."),
    (Event, "Describe a birthday party as JSON."),
]


def main():
    a = json.loads(sys.argv[1])
    client = openai.OpenAI(base_url=a["base_url"], api_key=a["api_key"], max_retries=0, timeout=300)
    model = a["model"]

    valid = total = 0
    failures = []
    for schema, question in CASES:
        for label, sampling in [("greedy", {"temperature": 0}), ("sampled", {"temperature": 0.8, "seed": 7})]:
            total += 1
            r = client.chat.completions.parse(
                model=model,
                messages=[{"role": "user", "content": question}],
                response_format=schema,
                max_tokens=256,
                **sampling,
            )
            c = r.choices[0]
            check(f"{schema.__name__} {label}: finished", c.finish_reason == "stop", (c.finish_reason, c.message.content))
            parsed = c.message.parsed
            check(f"{schema.__name__} {label}: parsed {parsed!r}", isinstance(parsed, schema), c.message.content)
            # pydantic validated it in parse(); validate again from the raw text, strictly (no
            # coercion: a number sent as a string, say, is refused), and count what passes.
            try:
                again = schema.model_validate_json(c.message.content, strict=True)
            except pydantic.ValidationError as e:
                failures.append(f"{schema.__name__} {label}: {e}: {c.message.content}")
                continue
            check(f"{schema.__name__} {label}: the strict validation is what parse() gave", again == parsed, c.message.content)
            valid += 1
    check(f"structured outputs: {valid}/{total} valid objects under strict validation", valid == total and total == 2 * len(CASES), failures)

    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": 'Give the weather in Paris as a JSON object with the keys "city" and "celsius".'}],
        response_format={"type": "json_object"},
        max_tokens=256,
        temperature=0,
    )
    text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    check("json_object answer finished", finish == "stop", (finish, text))
    check("json_object answer is a JSON object", isinstance(json.loads(text), dict), text)

    try:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "frobnicate"}}},
            max_tokens=8,
        )
        raise AssertionError("a bad schema was accepted")
    except openai.BadRequestError as e:
        body = e.body or {}
        check("a bad schema is a 400 naming response_format", body.get("param") == "response_format", e)

    print("all checks passed", flush=True)


if __name__ == "__main__":
    main()
