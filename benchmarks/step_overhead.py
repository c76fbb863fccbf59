"""Engine overhead per decode step: the share of an engine step spent outside the model's own work.

The in-process engine on the benchmark model (bf16), `--requests` requests of 64-token random prompts all decoding
`--tokens` tokens together. The model's work is timed where the worker calls it: the forward pass, the logits and
the C++ greedy steps of a multi-step call (`LlamaForCausalLM.greedy_decode`); everything else in `EngineCore.step`
(scheduling, input preparation, sampling, output handling) is overhead. Only steps where every request decodes
count (the prompt steps before are skipped). Target (issue 24): <= 10% of the step at 64 running requests.
    python benchmarks/step_overhead.py                    # 64 requests, multi-step as configured by default
    python benchmarks/step_overhead.py --scheduler-steps 1
    python benchmarks/step_overhead.py --temperature 0.8      # sampled: the sampler's work counts as overhead
    python benchmarks/step_overhead.py --temperature 0.8 --top-p 0.9 --top-k 40
"""
from __future__ import annotations

import argparse
import random
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.engine_core import EngineCore  # noqa: E402
from frontend import LLM, SamplingParams  # noqa: E402
from kernels.cpu_features import cpu_has_native_bf16  # noqa: E402
from launch.make_model import ensure_benchmark_model  # noqa: E402
from workers.model_runner import ModelRunner  # noqa: E402
from workers.models.llama import LlamaForCausalLM  # noqa: E402


class Timers:
    """Seconds inside the model's calls and the engine steps, counted only in steps where every request decodes."""

    def __init__(self) -> None:
        self.counting, self.model, self.steps, self.count = False, 0.0, 0.0, 0

    def wrap_model(self, cls: type, name: str) -> None:
        inner = getattr(cls, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.counting:
                    self.model += time.perf_counter() - start
        setattr(cls, name, timed)

    def wrap_step(self) -> None:
        inner = EngineCore.step

        def timed(engine: EngineCore):
            scheduler = engine.scheduler
            self.counting = bool(scheduler.running) and not scheduler.waiting and all(
                r.num_tokens - r.num_computed_tokens == 1 for r in scheduler.running)
            start = time.perf_counter()
            try:
                return inner(engine)
            finally:
                if self.counting:
                    self.steps += time.perf_counter() - start
                    self.count += 1
                self.counting = False
        EngineCore.step = timed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled requests (one step per call)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--scheduler-steps", type=int, default=None, help="num_scheduler_steps (default: the engine's)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    steps = {} if args.scheduler_steps is None else {"num_scheduler_steps": args.scheduler_steps}
    llm = LLM(str(ensure_benchmark_model()), dtype="bfloat16", in_process=True, max_num_seqs=max(args.requests, 1),
              **steps)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 8000) for _ in range(64)]} for _ in range(args.requests)]
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.tokens,
                            ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    timers = Timers()
    for name in ("_forward", "_logits"):
        timers.wrap_model(ModelRunner, name)
    timers.wrap_model(LlamaForCausalLM, "greedy_decode")
    timers.wrap_step()
    llm.generate(prompts, params, use_tqdm=False)
    overhead = timers.steps - timers.model
    print(f"CPU native bf16: {cpu_has_native_bf16()}; {args.requests} requests decoding {args.tokens} tokens "
          f"(temperature {args.temperature}, top-p {args.top_p}, top-k {args.top_k}), "
          f"{timers.count} engine steps of {timers.steps / timers.count * 1e3:.2f} ms: model {timers.model:.3f} s, "
          f"outside it {overhead:.3f} s = {overhead / timers.steps:.1%} of the steps (target <= 10%)")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
