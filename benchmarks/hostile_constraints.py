"""Four hostile schemas must not take structured output away from everyone else (issue: hostile constraints).

Starts `python -m launch` (the demo model unless --model), sends --hostile distinct JSON schemas of --properties
optional properties each, then at once --trivial small constrained requests (a two-word choice or a short regex),
and reports: each trivial request's latency and whether its output is valid; the hostile ones' statuses; then,
--settle seconds after the last reply, the engine process's CPU share (over 5 s) and its RSS against the RSS before
the hostile requests, with the compile workers' CPU beside it.

    python benchmarks/hostile_constraints.py    # targets: trivial <= 2 s, engine CPU < 10%, RSS within 200 MB
"""
from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from launcher import descendants, start_launcher, stop_launcher  # noqa: E402


def _hostile(index: int, properties: int) -> dict:
    schema = {"type": "object", "properties": {f"p{index}_{i}": {"type": "string"} for i in range(properties)}}
    return {"response_format": {"type": "json_schema", "json_schema": {"name": f"h{index}", "schema": schema}}}


def _trivial(index: int) -> tuple[dict, re.Pattern]:
    if index % 2:
        return {"structured_outputs": {"choice": ["yes", "no"]}}, re.compile(r"yes|no")
    return {"structured_outputs": {"regex": "[a-c]{2}x"}}, re.compile(r"[a-c]{2}x")


async def _scenario(base_url: str, args: argparse.Namespace) -> tuple[list, list]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        async def post(fields: dict) -> tuple[int, str, float]:
            start = time.monotonic()
            response = await http.post("/v1/completions", json={"prompt": "Answer:", "max_tokens": 16, **fields})
            text = response.json()["choices"][0]["text"] if response.status_code == 200 else response.text[:120]
            return response.status_code, text, time.monotonic() - start

        hostile = [asyncio.create_task(post(_hostile(i, args.properties))) for i in range(args.hostile)]
        await asyncio.sleep(0.2)  # they are in the engine first
        trivial_cases = [_trivial(i) for i in range(args.trivial)]
        trivial = await asyncio.gather(*(post(fields) for fields, _ in trivial_cases))
        checked = [(status, bool(pattern.fullmatch(text)), seconds)
                   for (status, text, seconds), (_, pattern) in zip(trivial, trivial_cases)]
        return checked, await asyncio.gather(*hostile)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the demo model)")
    parser.add_argument("--hostile", type=int, default=4)
    parser.add_argument("--properties", type=int, default=5000)
    parser.add_argument("--trivial", type=int, default=20)
    parser.add_argument("--settle", type=float, default=60.0)
    args = parser.parse_args()
    process, base_url = start_launcher(["--model", args.model] if args.model else [])
    try:
        [engine_pid] = [pid for pid, command in descendants(process.pid) if "core.engine_process" in command]
        engine = psutil.Process(engine_pid)
        rss_before = engine.memory_info().rss
        trivial, hostile = asyncio.run(_scenario(base_url, args))
        print(f"trivial: {sum(s == 200 and ok for s, ok, _ in trivial)}/{len(trivial)} valid 200s, latency "
              f"max {max(t for _, _, t in trivial):.2f} s, median {sorted(t for _, _, t in trivial)[len(trivial) // 2]:.2f} s")
        print("hostile:", [(status, round(seconds, 1)) for status, _, seconds in hostile])
        time.sleep(args.settle)
        workers = [psutil.Process(pid) for pid, command in descendants(engine_pid) if "compile_worker" in command]
        for proc in [engine, *workers]:
            proc.cpu_percent(None)
        time.sleep(5.0)
        print(f"{args.settle:g} s later: engine CPU {engine.cpu_percent(None):.1f}%, RSS "
              f"{engine.memory_info().rss / 2**20:.0f} MiB (before: {rss_before / 2**20:.0f} MiB); compile workers "
              f"CPU {[round(w.cpu_percent(None), 1) for w in workers]}%")
    finally:
        stop_launcher(process)


if __name__ == "__main__":
    main()
