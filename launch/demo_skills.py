"""Generated chat turns that teach the demo model to end JSON objects and to make one tool call, then stop."""
from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

# Values by kind of field: short, so a constrained answer closes its strings, numbers and lists within a few tokens.
_WORDS = {
    "person": ["John", "Alice", "Bob", "Maria", "Chen Wei", "Priya", "Omar", "Anna Smith", "Luis", "Yuki", "Sam",
               "Fatima", "Peter", "Emma", "Ivan", "Grace Hopper", "Ada Lovelace", "Linus", "Noor", "Kofi"],
    "city": ["Paris", "London", "Tokyo", "Berlin", "Rome", "New York", "Lagos", "Lima", "Oslo", "Madrid",
             "Sydney", "Cairo", "Seoul", "Boston", "Delhi", "Toronto", "Nairobi", "Prague", "Austin", "Dublin"],
    "country": ["France", "Japan", "Brazil", "Kenya", "Canada", "India", "Spain", "Norway", "Peru", "Egypt"],
    "color": ["red", "blue", "green", "black", "white", "yellow", "purple", "orange"],
    "language": ["English", "French", "Spanish", "German", "Japanese", "Hindi", "Swahili", "Python"],
    "title": ["Hamlet", "The Odyssey", "Dune", "Weekly report", "Team meeting", "Science fair", "Launch party",
              "Budget review", "Moby Dick", "Project kickoff"],
    "phrase": ["It is sunny.", "Add 23 to both sides.", "x = -3.75", "Use a list.", "Not enough data.", "42",
               "Move the file first.", "Yes", "Call the API twice.", "Sort the items by date.", "It failed.",
               "Subtract 7, then divide by 8.", "The answer is 12.", "Restart the server."],
    "tz": ["UTC", "Europe/Paris", "Asia/Tokyo", "America/New_York", "Europe/London", "Australia/Sydney"],
    "date": ["2024-05-01", "2025-01-17", "Friday", "2023-12-31", "tomorrow", "June 3", "2026-02-10"],
    "time": ["09:00", "14:30", "noon", "18:45", "7 pm"],
    "email": ["alice@example.com", "bob@example.org", "team@example.com", "sam@example.net"],
    "symbol": ["AAPL", "MSFT", "GOOG", "TSLA", "NVDA"],
    "currency": ["USD", "EUR", "JPY", "GBP", "INR"],
    "query": ["python list sort", "weather radar", "best pizza", "json schema", "train times", "flu symptoms"],
}
_NUMBERS: dict[str, Callable[[random.Random], Any]] = {
    "age": lambda r: r.randint(1, 90), "count": lambda r: r.randint(0, 20), "year": lambda r: r.randint(1900, 2030),
    "price": lambda r: round(r.uniform(1, 500), 2), "score": lambda r: round(r.uniform(0, 10), 1),
    "id": lambda r: r.randint(1, 9999), "amount": lambda r: r.randint(1, 1000),
}
# field name -> kind (a _WORDS list, a _NUMBERS rule, "bool", "list" of persons/words, "steps" of objects)
FIELDS = {
    "name": "person", "author": "person", "owner": "person", "city": "city", "location": "city",
    "country": "country", "color": "color", "language": "language", "title": "title", "event": "title",
    "answer": "phrase", "reason": "phrase", "explanation": "phrase", "output": "phrase", "final_answer": "phrase",
    "summary": "phrase", "description": "phrase", "timezone": "tz", "date": "date", "time": "time",
    "email": "email", "symbol": "symbol", "currency": "currency", "query": "query", "age": "age", "count": "count",
    "year": "year", "price": "price", "score": "score", "id": "id", "amount": "amount", "quantity": "count",
    "rating": "score", "is_valid": "bool", "active": "bool", "done": "bool", "participants": "list",
    "tags": "list", "items": "list", "keywords": "list", "steps": "steps",
}
_TYPES = {"bool": "boolean", "price": "number", "score": "number"}  # of the kinds not numbers, lists or steps


def _schema_of(field: str) -> dict:
    kind = FIELDS[field]
    if kind in _NUMBERS and kind not in _TYPES:
        return {"type": "integer"}
    if kind == "list":
        return {"type": "array", "items": {"type": "string"}}
    if kind == "steps":
        step = {"type": "object", "properties": {"explanation": {"type": "string"}, "output": {"type": "string"}},
                "required": ["explanation", "output"]}
        return {"type": "array", "items": step}
    return {"type": _TYPES.get(kind, "string")}


def value_of(field: str, rng: random.Random) -> Any:
    kind = FIELDS[field]
    if kind in _NUMBERS:
        return _NUMBERS[kind](rng)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "list":
        return rng.sample(_WORDS["person"] if field == "participants" else _WORDS["query"], rng.randint(1, 3))
    if kind == "steps":
        return [{"explanation": rng.choice(_WORDS["phrase"]), "output": rng.choice(_WORDS["phrase"])}
                for _ in range(rng.randint(1, 2))]
    return rng.choice(_WORDS[kind])


def random_schema(rng: random.Random) -> dict:
    """An object schema of 1-4 known fields, as a pydantic model's JSON schema lists them."""
    names = rng.sample(sorted(FIELDS), rng.randint(1, 4))
    return {"type": "object", "properties": {n: _schema_of(n) for n in names}, "required": names}


def values_for(schema: dict, rng: random.Random) -> dict:
    return {name: value_of(name, rng) for name in schema["properties"]}


def _mention(values: dict) -> str:
    """The values as a sentence mentions them, so the model learns to copy them into its answer."""
    parts = [f"{k.replace('_', ' ')} {', '.join(map(str, v)) if isinstance(v, list) else v}"
             for k, v in values.items() if not isinstance(v, list) or not v or not isinstance(v[0], dict)]
    return "; ".join(parts)


def json_turn(rng: random.Random) -> list[dict]:
    """A user asks for an object (the values in the question or not, the schema in the prompt or not); the
    assistant answers with the object alone."""
    schema = random_schema(rng)
    values = values_for(schema, rng)
    keys = ", ".join(schema["properties"])
    question = rng.choice([
        f"Extract: {_mention(values)}.", f"Extract the {keys} from this text: {_mention(values)}.",
        f"Return JSON with {keys}.", f"Fill in {keys} as JSON.", f"Give me a JSON object: {_mention(values)}",
        f"Answer in JSON matching this schema: {json.dumps(schema)}", f"Describe a {rng.choice(_WORDS['title'])}.",
        f"Who is {rng.choice(_WORDS['person'])}?", f"Solve {rng.randint(2, 9)}x + {rng.randint(1, 9)} = "
        f"{rng.randint(-30, 30)} step by step.", "Tell me about the weather.", f"{_mention(values)}"])
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": json.dumps(values)}]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": rng.choice(
            ["Answer in JSON.", "You are a helpful assistant.", "Be brief.", "You extract data as JSON."])})
    return messages


Tool = tuple[str, str, list[str], list[str]]  # name, description, parameters (required first), questions
TOOLS: list[Tool] = [
    ("get_weather", "Get the current weather in a city", ["city", "unit"],
     ["What's the weather in {city}?", "Weather in {city}?", "Is it raining in {city}?", "How hot is it in {city}?"]),
    ("get_current_weather", "Get the current weather in a given location", ["location", "unit"],
     ["What's the weather like in {location}?", "Weather in {location} today?"]),
    ("get_time", "Current time in a timezone", ["timezone"],
     ["What time is it in {timezone}?", "Current time in {timezone}?"]),
    ("search", "Search the web", ["query"], ["Search for {query}.", "Look up {query}."]),
    ("send_email", "Send an email", ["email", "title"], ["Email {email} about {title}.", "Send {title} to {email}."]),
    ("get_stock_price", "Get a stock's price", ["symbol"], ["Price of {symbol}?", "How is {symbol} doing?"]),
    ("convert_currency", "Convert an amount between currencies", ["amount", "currency"],
     ["Convert {amount} to {currency}.", "How much is {amount} in {currency}?"]),
    ("get_user", "Look up a user by id", ["id"], ["Who is user {id}?", "Find user {id}."]),
    ("create_event", "Create a calendar event", ["title", "date"], ["Schedule {title} on {date}.",
                                                                     "Add {title} to my calendar for {date}."]),
    ("translate", "Translate text", ["query", "language"], ["Translate {query} into {language}."]),
    ("book_table", "Book a restaurant table", ["city", "time", "count"],
     ["Book a table for {count} in {city} at {time}."]),
]


def tool_spec(tool: Tool) -> dict:
    name, description, params, _ = tool
    properties = {p: _schema_of(p) for p in params if p != "unit"}
    if "unit" in params:
        properties["unit"] = {"type": "string", "enum": ["celsius", "fahrenheit"]}
    required = [p for p in params if p != "unit"]
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


def _arguments(tool: Tool, rng: random.Random) -> tuple[str, dict]:
    """(the question, the call's arguments: the required ones, `unit` when the question names it)."""
    _, _, params, questions = tool
    args = {p: value_of(p, rng) for p in params if p != "unit"}
    question = rng.choice(questions).format(**args)
    if "unit" in params and rng.random() < 0.3:
        args["unit"] = rng.choice(["celsius", "fahrenheit"])
        question += f" In {args['unit']}."
    return question, args


def tool_turn(rng: random.Random) -> tuple[list[dict], list[dict]]:
    """(messages, tools): a question one of 1-3 listed tools answers, answered by one call in the template's
    <tool_call> form (the form every tool choice is served in, see frontend/api/tools.py), sometimes followed by
    the tool's result and a short answer."""
    tools = rng.sample(TOOLS, rng.randint(1, 3))
    chosen = rng.choice(tools)
    question, args = _arguments(chosen, rng)
    messages = [{"role": "user", "content": question}]
    if rng.random() < 0.25:
        messages.insert(0, {"role": "system", "content": rng.choice(["You are a helpful assistant.", "Be brief.",
                                                                     "Use the tools."])})
    call = {"type": "function", "function": {"name": chosen[0], "arguments": args}}
    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    if rng.random() < 0.3:
        result = {"result": value_of(rng.choice(sorted(FIELDS)), rng)}
        messages += [{"role": "tool", "content": json.dumps(result)},
                     {"role": "assistant", "content": f"The result is {result['result']}."}]
    return messages, [tool_spec(t) for t in tools]


def skill_documents(render: Callable[[list[dict], list[dict] | None], str], count: int, seed: int) -> list[str]:
    """`count` rendered conversations, half JSON answers and half tool calls, seeded."""
    rng = random.Random(seed)
    documents = []
    for index in range(count):
        if index % 2:
            documents.append(render(*tool_turn(rng)))
        else:
            documents.append(render(json_turn(rng), None))
    return documents
