"""Hostile inputs must not deny service to anyone else. Starts `python -m launch` (the demo model unless --model)
and runs three phases against it, one at a time:

1. constraints: after one constrained request (the compile workers start with the engine, so one sent at once
   may wait for them), --hostile distinct JSON schemas of --properties optional properties each, then at once --trivial
   small constrained requests (a two-word choice or a short regex): each trivial request's latency and whether its
   output is valid, the hostile ones' statuses; --settle seconds after the last reply, the engine's CPU share (over
   5 s) and RSS against its RSS before, with the compile workers' CPU beside it.
2. adapters (a second launcher with --enable-lora --allow-runtime-lora): while one request streams, load
   adapters whose folder holds a FIFO, a device file, or is a symlink out of --lora-dir; each answer's latency and
   the stream's longest gap between tokens meanwhile.
3. bodies: while one request streams, three concurrent 9 MiB prompts; /health's worst latency and the stream's
   longest gap between tokens meanwhile.

    python benchmarks/hostile_inputs.py   # targets: trivial <= 2 s, CPU < 10%, RSS +200 MB, adapters <= 1 s,
                                          # gaps and /health < 0.5 s
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import tempfile
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


async def _while_streaming(base_url: str, work) -> tuple[object, float]:
    """(what `work(http)` returns, the longest gap between a running stream's tokens while it ran)."""
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        body = {"prompt": "Once", "max_tokens": 100000, "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.aiter_lines()
            await anext(lines)
            arrivals: list[float] = []

            async def read() -> None:
                async for _ in lines:
                    arrivals.append(time.monotonic())

            reader = asyncio.create_task(read())
            await asyncio.sleep(0.5)
            start = time.monotonic()
            result = await work(http)
            end = time.monotonic()
            await asyncio.sleep(0.3)
            reader.cancel()
    during = [t for t in arrivals if start <= t <= end + 0.3]
    gaps = [b - a for a, b in zip(during, during[1:])] or [end - start]
    return result, max(gaps)


def constraints(args: argparse.Namespace) -> None:
    process, base_url = start_launcher(["--model", args.model] if args.model else [])
    try:
        [engine_pid] = [pid for pid, command in descendants(process.pid) if "core.engine_process" in command]
        engine = psutil.Process(engine_pid)
        start = time.monotonic()  # the compile workers start with the engine; right after /health they may not be up
        warm = httpx.post(f"{base_url}/v1/completions", timeout=600, json={
            "prompt": "Answer:", "max_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}})
        print(f"constraints: first constrained request right after /health: {warm.status_code} in "
              f"{time.monotonic() - start:.2f} s")
        rss_before = engine.memory_info().rss
        trivial, hostile = asyncio.run(_scenario(base_url, args))
        latencies = sorted(t for _, _, t in trivial)
        print(f"  trivial {sum(s == 200 and ok for s, ok, _ in trivial)}/{len(trivial)} valid 200s, "
              f"latency max {latencies[-1]:.2f} s, median {latencies[len(latencies) // 2]:.2f} s; hostile "
              f"{[(status, round(seconds, 1)) for status, _, seconds in hostile]}")
        time.sleep(args.settle)
        workers = [psutil.Process(pid) for pid, command in descendants(engine_pid) if "compile_worker" in command]
        for proc in [engine, *workers]:
            proc.cpu_percent(None)
        time.sleep(5.0)
        print(f"  {args.settle:g} s later: engine CPU {engine.cpu_percent(None):.1f}%, RSS "
              f"{engine.memory_info().rss / 2**20:.0f} MiB (before: {rss_before / 2**20:.0f} MiB); compile workers "
              f"CPU {[round(w.cpu_percent(None), 1) for w in workers]}%")
    finally:
        stop_launcher(process)


def adapters(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as folder:
        lora_dir = Path(folder) / "adapters"
        (lora_dir / "fifo").mkdir(parents=True)
        os.mkfifo(lora_dir / "fifo" / "adapter_config.json")
        (lora_dir / "device").mkdir()
        (lora_dir / "device" / "adapter_config.json").symlink_to("/dev/zero")
        (Path(folder) / "elsewhere").mkdir()
        (lora_dir / "outside").symlink_to(Path(folder) / "elsewhere", target_is_directory=True)
        process, base_url = start_launcher([*(["--model", args.model] if args.model else []), "--enable-lora",
                                            "--allow-runtime-lora", "--lora-dir", str(lora_dir)])
        try:
            async def load_all(http: httpx.AsyncClient) -> list[tuple[str, int, float]]:
                answers = []
                for name in ("fifo", "device", "outside"):
                    start = time.monotonic()
                    response = await http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": name})
                    answers.append((name, response.status_code, round(time.monotonic() - start, 3)))
                return answers
            answers, gap = asyncio.run(_while_streaming(base_url, load_all))
            print(f"adapters: {answers} (name, status, seconds); longest gap between stream tokens meanwhile "
                  f"{gap * 1000:.0f} ms")
        finally:
            stop_launcher(process)


def bodies(args: argparse.Namespace) -> None:
    process, base_url = start_launcher(["--model", args.model] if args.model else [])
    huge = "lorem ipsum dolor sit amet " * (9 * 2**20 // 27)
    try:
        async def send(http: httpx.AsyncClient) -> tuple[list[int], float]:
            posts = asyncio.gather(*(http.post("/v1/completions", json={"prompt": huge, "max_tokens": 2})
                                     for _ in range(3)))
            worst = 0.0
            while not posts.done():
                start = time.monotonic()
                await http.get("/health")
                worst = max(worst, time.monotonic() - start)
                await asyncio.sleep(0.01)
            return [r.status_code for r in await posts], worst
        (statuses, health), gap = asyncio.run(_while_streaming(base_url, send))
        print(f"bodies: statuses {statuses}; /health worst {health * 1000:.0f} ms; longest gap between stream "
              f"tokens meanwhile {gap * 1000:.0f} ms")
    finally:
        stop_launcher(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model folder (default: the demo model)")
    parser.add_argument("--hostile", type=int, default=4)
    parser.add_argument("--properties", type=int, default=5000)
    parser.add_argument("--trivial", type=int, default=20)
    parser.add_argument("--settle", type=float, default=60.0)
    phases = {"constraints": constraints, "adapters": adapters, "bodies": bodies}
    parser.add_argument("--phases", nargs="+", default=list(phases), choices=list(phases))
    args = parser.parse_args()
    for phase in args.phases:
        phases[phase](args)


if __name__ == "__main__":
    main()
