"""Fuzzing the gateway with schemathesis: requests generated from the contract it serves (/openapi.json, read with
the API key), ones that fit it and ones that break it, sent to the real server. No request may get a 5xx, and the
server must stay healthy. PAGEDSERVE_FUZZ_CASES sets the number of requests (default 300)."""
from __future__ import annotations

import math
import os
from collections import Counter

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import APIOperation, GenerationMode

from conftest import AUTH

CASES = int(os.environ.get("PAGEDSERVE_FUZZ_CASES", "300"))


class _Fuzzer:
    """Sends the cases of one operation and generation mode at a time, tallying the status codes and the 5xxs."""

    def __init__(self, base_url: str, model: str) -> None:
        self.base_url, self.model = base_url, model
        self.statuses: Counter[int] = Counter()
        self.server_errors: list[str] = []

    def run(self, operation: APIOperation, mode: GenerationMode, max_examples: int) -> None:
        # derandomize: the same cases on every run (a seed derived from the test), so a failure reproduces
        @settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def send(case: schemathesis.Case) -> None:
            if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
                case.body["model"] = self.model  # a random model name is a 404 before anything else is looked at
            response = case.call(base_url=self.base_url, headers=AUTH, timeout=120)
            self.statuses[response.status_code] += 1
            if response.status_code >= 500:
                self.server_errors.append(f"{operation.label} {mode.value} {case.body!r} -> {response.status_code} "
                                          f"{response.text[:300]}")
        send()


def test_no_generated_request_gets_a_server_error(server, llama_model):
    base_url = server[1]
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", headers=AUTH)
    operations = [result.ok() for result in schema.get_all_operations()]
    with_body = [operation for operation in operations if list(operation.body)]
    # Operations without parameters have one possible request each; the cases go to those with a body.
    per_run = math.ceil(CASES / (2 * len(with_body)))
    fuzzer = _Fuzzer(base_url, llama_model)
    for operation in operations:
        fuzzer.run(operation, GenerationMode.POSITIVE, per_run)
        if operation in with_body:
            fuzzer.run(operation, GenerationMode.NEGATIVE, per_run)
    print(f"fuzz: {sum(fuzzer.statuses.values())} requests, status codes {dict(sorted(fuzzer.statuses.items()))}")
    assert sum(fuzzer.statuses.values()) >= CASES
    assert not fuzzer.server_errors, "\n".join(fuzzer.server_errors)
    assert httpx.get(f"{base_url}/health").status_code == 200
