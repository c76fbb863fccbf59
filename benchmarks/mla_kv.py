"""MLA's KV cache against multi-head attention of the same model: bytes per token, and how many requests a fixed
KV budget holds at once, from the scheduler's stats.

The MLA model is the model maker's "30m" DeepSeek-V2 (8 layers, 8 heads of 32 no-rope + 32 rope dims, values of
64, a 256-dim latent); its multi-head twin is the "30m" llama with 8 KV heads of 64 dims, the K and V a
multi-head cache of that attention would hold (head_dim = qk_nope + qk_rope = v_head_dim = 64). Both engines get
the same --kv-cache-memory and the same requests, more than fit at once; the figure is the ratio of their
`peak_num_running`, which should equal the bytes-per-token ratio (issue 19).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import throughput  # noqa: E402
from frontend import LLM, SamplingParams  # noqa: E402
from launch.make_model import benchmark_cache_dir, make_model  # noqa: E402


def models() -> dict[str, Path]:
    cache = benchmark_cache_dir()
    return {"mla": make_model(cache / "mla-benchmark-model", "deepseek_v2", "30m"),
            "mha": make_model(cache / "mha-twin-benchmark-model", "llama", "30m", num_key_value_heads=8)}


def kv_bytes_per_token(config, dtype_bytes: int) -> dict[str, int]:
    """Per token over all layers: MLA's latent + rope key, and the K and V of the same heads expanded."""
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    mla = layers * (config.kv_lora_rank + config.qk_rope_head_dim) * dtype_bytes
    mha = layers * heads * (config.qk_nope_head_dim + config.qk_rope_head_dim + config.v_head_dim) * dtype_bytes
    return {"mla": mla, "mha": mha}


def run(model: Path, requests, args) -> dict:
    llm = LLM(str(model), dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, in_process=True)
    try:
        prompts = [{"prompt_token_ids": p} for p, _ in requests]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
        llm.generate(prompts, params, use_tqdm=False)
        stats = llm.get_stats()
        return {"num_kv_blocks": llm.info.num_kv_blocks, "peak_num_running": stats.peak_num_running,
                "num_preemptions": stats.num_preemptions}
    finally:
        llm.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory", type=int, default=128 * 2**20, help="bytes, the same for both")
    parser.add_argument("--num-requests", type=int, default=160)
    parser.add_argument("--input-len", type=int, default=240)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    # Large, so that the cache fills before the first requests finish: what fits is then what the KV holds.
    parser.add_argument("--max-num-batched-tokens", type=int, default=32768)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    from transformers import AutoConfig
    paths = models()
    config = AutoConfig.from_pretrained(paths["mla"])
    per_token = kv_bytes_per_token(config, 2 if args.dtype == "bfloat16" else 4)
    expected = per_token["mha"] / per_token["mla"]
    print(f"KV bytes per token ({args.dtype}, {config.num_hidden_layers} layers): MLA {per_token['mla']}, "
          f"multi-head {per_token['mha']}: {expected:.2f}x smaller")
    requests = throughput.make_requests(args.num_requests, config.vocab_size, 0, (args.input_len,) * 2,
                                        (args.output_len,) * 2)
    results = {"kv_bytes_per_token": per_token, "bytes_ratio": expected,
               **{kind: run(path, requests, args) for kind, path in paths.items()}}
    running = results["mla"]["peak_num_running"] / results["mha"]["peak_num_running"]
    results["running_ratio"] = running
    for kind in ("mla", "mha"):
        r = results[kind]
        print(f"{kind}: {r['num_kv_blocks']} KV blocks in {args.kv_cache_memory} bytes, at most "
              f"{r['peak_num_running']} requests running at once ({r['num_preemptions']} preemptions)")
    print(f"requests running at once, MLA / multi-head: {running:.2f}x (bytes ratio {expected:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
