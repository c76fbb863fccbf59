"""Writes sharegpt_demo.json: ShareGPT-format conversations for the serving benchmark from the demo model's corpus.

Each conversation asks for a documented standard-library function ("Write a Python function `name(args)`: <its
docstring's first line>") and answers with its source, as the demo model was trained to; every third one goes on to a
second function of the same file. The choice is a stable hash of the question, so the same Python writes the same
file, and nothing is downloaded.

    python benchmarks/data/make_sharegpt_demo.py [--num 200] [--out benchmarks/data/sharegpt_demo.json]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from launch.demo_corpus import chat_pairs, stdlib_files  # noqa: E402

MAX_ANSWER_CHARS = 700  # the demo model's context is 512 tokens: question and answer fit it with room to spare


def turn(speaker: str, text: str) -> dict[str, str]:
    return {"from": speaker, "value": text}


def conversations(num: int) -> list[dict]:
    by_file = [[pair for pair in chat_pairs(file) if len(pair[1]) <= MAX_ANSWER_CHARS] for file in stdlib_files()]
    candidates = [(pairs[i], pairs[i + 1] if i + 1 < len(pairs) else None)
                  for pairs in by_file for i in range(len(pairs))]
    candidates.sort(key=lambda c: hashlib.sha256(c[0][0].encode()).digest())
    chosen = []
    for index, ((question, answer), follow_up) in enumerate(candidates[:num]):
        turns = [turn("human", question), turn("gpt", answer)]
        if index % 3 == 2 and follow_up is not None:
            turns += [turn("human", follow_up[0]), turn("gpt", follow_up[1])]
        chosen.append({"id": f"demo-{index}", "conversations": turns})
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "sharegpt_demo.json")
    args = parser.parse_args()
    args.out.write_text(json.dumps(conversations(args.num), indent=1) + "\n", encoding="utf-8")
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
