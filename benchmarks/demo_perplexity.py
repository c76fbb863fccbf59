"""Held-out perplexity of a demo model on stdlib files it never saw: through the engine's prompt_logprobs, and
cross-checked with HF transformers on the same tokens (both float32).

The held-out files are the training run's (its seed, from training_log.json). Their token stream (each file
followed by <|endoftext|>) is cut into windows of the model's context; each window is scored on its own, so the
first token of a window is not scored. Example:
    python benchmarks/demo_perplexity.py                       # the shipped demo model
    python benchmarks/demo_perplexity.py --model launch/weights/draft --windows 16
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from frontend import LLM, SamplingParams  # noqa: E402
from launch.demo_corpus import split, stdlib_files  # noqa: E402
from launch.demo_tokens import held_out_windows, token_stream  # noqa: E402
from launch.shipped import WEIGHTS_DIR  # noqa: E402
from launch.train_demo import HELD_OUT_FRACTION  # noqa: E402


def held_out_tokens(model: Path, windows: int) -> torch.Tensor:
    """[windows, context - 1] token ids of the run's held-out files."""
    from transformers import AutoTokenizer
    run = json.loads((model / "training_log.json").read_text())
    _, held = split(stdlib_files(), HELD_OUT_FRACTION, run["seed"])
    tokenizer = AutoTokenizer.from_pretrained(model)
    return held_out_windows(token_stream(tokenizer.backend_tokenizer, [f.text for f in held]),
                            run["recipe"]["context"] - 2, windows)  # + 1 generated token fits the context


def engine_nll(model: Path, windows: torch.Tensor) -> float:
    """Summed negative log-likelihood of every window's tokens after the first, from prompt_logprobs."""
    llm = LLM(str(model), dtype="float32", in_process=True)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outputs = llm.generate([{"prompt_token_ids": w.tolist()} for w in windows], params, use_tqdm=False)
    llm.shutdown()
    return -sum(entry[token].logprob for output, w in zip(outputs, windows)
                for entry, token in zip(output.prompt_logprobs[1:], w[1:].tolist()))


@torch.no_grad()
def hf_nll(model: Path, windows: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    total = 0.0
    for w in windows:
        logits = hf(input_ids=w[None, :-1]).logits[0].float()
        total += torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum").item()
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=WEIGHTS_DIR / "demo")
    parser.add_argument("--windows", type=int, default=64, help="held-out windows to score (at most)")
    args = parser.parse_args()
    windows = held_out_tokens(args.model, args.windows)
    count = windows.shape[0] * (windows.shape[1] - 1)
    engine, reference = engine_nll(args.model, windows), hf_nll(args.model, windows)
    relative = abs(engine - reference) / reference
    print(f"{args.model}: {count} held-out tokens in {windows.shape[0]} windows of {windows.shape[1]}")
    print(f"  engine prompt_logprobs: loss {engine / count:.4f}, perplexity {math.exp(engine / count):.2f}")
    print(f"  HF transformers:        loss {reference / count:.4f}, perplexity {math.exp(reference / count):.2f}")
    print(f"  relative difference of the summed NLL: {relative:.2e} (target <= 1e-3)")
    return 0 if relative <= 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
