"""Garbage and hostile constraints over HTTP: seeded random JSON schemas, regexes, grammars and choice lists,
well-formed or not, and hostile shapes (deep nesting, $ref cycles, huge enums and unions, large repetition counts).
Each request gets a 200 or a 400 with an OpenAI error body, never a 5xx; the engine serves on, and its CPU and memory
come back down. PAGEDSERVE_FUZZ_CONSTRAINTS sets the number of cases (default 1700)."""
from __future__ import annotations

import os
import random
import time
from collections import Counter
from typing import Any

import httpx
import psutil

from conftest import AUTH
from launcher import descendants, engine_pid

CASES = int(os.environ.get("PAGEDSERVE_FUZZ_CONSTRAINTS", "1700"))
KEYWORDS = ["type", "properties", "required", "items", "enum", "const", "anyOf", "oneOf", "allOf", "not", "$ref",
            "$defs", "minimum", "maximum", "minLength", "maxLength", "pattern", "format", "minItems", "maxItems",
            "additionalProperties", "uniqueItems", "multipleOf", "prefixItems", "if", "then", "else"]
TYPES = ["object", "array", "string", "integer", "number", "boolean", "null", "nonsense"]
REGEX_PIECES = list("()[]{}*+?|^$\\.-,") + ["a", "b", "z", "0", "9", "{2}", "{1,3}", "\\d", "\\w", "[a-z]", "(?:",
                                            "(?=", "\\p{L}", "é", "\n"]
GRAMMAR_PIECES = ["root", " ::= ", '"a"', '"b\\"', " | ", "(", ")", "*", "+", "?", "[a-z]", "[^", "x", "\n", "{1,3}",
                  "rule", " ", '""', "::=", "#", "\\u00e9"]


def _value(rng: random.Random, depth: int) -> Any:
    choice = rng.randrange(9 if depth < 4 else 6)
    if choice == 0:
        return rng.choice(TYPES)
    if choice == 1:
        return rng.choice([0, -1, 2.5, 10**12, -(10**30), 3])
    if choice == 2:
        return rng.choice([True, False, None])
    if choice == 3:
        return "".join(rng.choice(REGEX_PIECES) for _ in range(rng.randrange(1, 6)))
    if choice == 4:
        return f"#/$defs/{rng.choice(['a', 'missing', ''])}"
    if choice == 5:
        return rng.choice(["date", "email", "uuid", "no-such-format", ""])
    if choice == 6:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return _schema(rng, depth + 1)


def _schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    keys = rng.sample(KEYWORDS, rng.randrange(1, 5)) + ([f"x{rng.randrange(9)}"] if rng.random() < 0.2 else [])
    schema = {key: _value(rng, depth) for key in keys}
    if "properties" in schema and rng.random() < 0.7:
        schema["properties"] = {f"p{i}": _schema(rng, depth + 1) if depth < 3 else {"type": "integer"}
                                for i in range(rng.randrange(1, 3))}
    return schema


def _nested(rng: random.Random, depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": rng.choice(["integer", "string", "null"])}
    for _ in range(depth):
        schema = rng.choice([{"type": "array", "items": schema, "maxItems": 2},
                             {"type": "object", "properties": {"a": schema}, "required": ["a"]},
                             {"anyOf": [schema, {"type": "null"}]}])
    return schema


def _hostile(rng: random.Random) -> dict[str, Any]:
    """A constraint shaped to cost the compiler or lead nowhere, within what compiles in about a second."""
    size = rng.choice([10, 100, 1000, 4000])
    shapes = [
        lambda: {"json": _nested(rng, rng.randrange(20, 80))},
        lambda: {"json": {"$ref": "#"}},
        lambda: {"json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
        lambda: {"json": {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}},
        lambda: {"json": {"enum": [f"v{i}" for i in range(size)]}},
        lambda: {"json": {"anyOf": [{"const": i} for i in range(min(size, 300))]}},
        lambda: {"json": {"type": "string", "pattern": f"(a|b){{{size}}}"}},
        lambda: {"json": {"type": "array", "items": {"type": "integer"}, "minItems": size, "maxItems": 10**9}},
        lambda: {"json": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(50)}}},
        lambda: {"regex": rng.choice(["a", "(a|b)", "[a-z]", "(a*)*", "(a|aa)+"]) + f"{{{size},{size * 2}}}"},
        lambda: {"grammar": "root ::= " + " ".join(f"r{i}" for i in range(50)) + "\n" +
                 "\n".join(f"r{i} ::= r{i + 1} | \"x\"" for i in range(50)) + '\nr50 ::= "y"'},
        lambda: {"grammar": "root ::= a\na ::= b\nb ::= a"},
        lambda: {"choice": [f"option {i}" for i in range(size)]},
    ]
    return {"structured_outputs": rng.choice(shapes)()}


def _constraint(rng: random.Random) -> dict[str, Any]:
    if rng.random() < 0.25:
        return _hostile(rng)
    kind = rng.randrange(5)
    if kind == 0:
        return {"structured_outputs": {"json": _schema(rng)}}
    if kind == 1:
        return {"guided_regex": "".join(rng.choice(REGEX_PIECES) for _ in range(rng.randrange(1, 25)))}
    if kind == 2:
        return {"guided_grammar": "".join(rng.choice(GRAMMAR_PIECES) for _ in range(rng.randrange(1, 20)))}
    if kind == 3:
        return {"guided_choice": ["".join(rng.choice(REGEX_PIECES + ['"', "\x01", ""]) for _ in range(rng.randrange(4)))
                                  for _ in range(rng.randrange(0, 4))]}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _schema(rng)}}}


def test_garbage_constraints_get_400s_and_the_engine_serves_on(server, llama_model):
    base_url, rng, statuses, bad = server[1], random.Random(0), Counter(), []
    engine = psutil.Process(engine_pid(server[0].pid))
    rss_before = engine.memory_info().rss
    with httpx.Client(base_url=base_url, headers=AUTH, timeout=60) as http:
        for _ in range(CASES):
            body = {"model": llama_model, "prompt": "x", "max_tokens": 4, **_constraint(rng)}
            response = http.post("/v1/completions", json=body)
            statuses[response.status_code] += 1
            if response.status_code not in (200, 400):
                bad.append(f"{body} -> {response.status_code} {response.text[:300]}")
            elif response.status_code == 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert http.get("/health").status_code == 200
    print(f"constraint fuzz: {CASES} requests, status codes {dict(statuses)}")
    assert not bad, "\n".join(bad[:20])
    assert statuses[400] >= CASES // 4 and statuses[200] >= CASES // 20  # both kinds were exercised
    # Nothing keeps compiling or growing once the requests are answered: the engine and its compile workers idle.
    engine.cpu_percent(None)
    workers = [psutil.Process(pid) for pid, command in descendants(engine.pid) if "compile_worker" in command]
    for worker in workers:
        worker.cpu_percent(None)
    time.sleep(2.0)
    assert engine.cpu_percent(None) < 10.0 and all(worker.cpu_percent(None) < 10.0 for worker in workers)
    assert engine.memory_info().rss - rss_before < 200 * 2**20
