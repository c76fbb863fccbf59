"""`pagedserve serve MODEL` / `python -m launch` / `python launch/launch.py`: serve a model over an OpenAI-compatible
HTTP API (the built-in demo model when none is given). Starts one engine core and --api-server-count gateway
processes sharing one port, supervises them, and takes everything down on Ctrl-C / SIGTERM (in-flight requests get
--shutdown-timeout).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

if not __package__:  # run as `python launch/launch.py`: `launch` must be this package, not this file
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from frontend.api.cli_args import (API_KEY_ENV, add_gateway_flags, auto_tool_parser, check_lora_flags,  # noqa: E402
                                   )
from frontend.api.lora_adapters import parse_lora_modules  # noqa: E402
from ipc import EngineConfig  # noqa: E402
from ipc.config import DP_BACKENDS, DP_ROUTING, KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATION_METHODS  # noqa: E402
from ipc.pooling import RUNNERS  # noqa: E402
from launch.shipped import DEMO_MODEL_NAME, shipped_model  # noqa: E402
from launch import dp_nodes  # noqa: E402
from launch.supervisor import Launcher  # noqa: E402

logger = logging.getLogger("pagedserve.launch")
_GATEWAY_START_TIMEOUT_S = 120.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", usage="%(prog)s [serve] [MODEL] [options]",
                                     description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", help="HF-format model folder (or --model)")
    parser.add_argument("--model", help="HF-format model folder (default: the shipped trained demo model)")
    parser.add_argument("--served-model-name", help=f"the model id clients use (default: MODEL; for the demo model "
                                                    f"{DEMO_MODEL_NAME})")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP host (default loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    parser.add_argument("--api-server-count", type=int, default=1, help="gateway processes sharing the port")
    parser.add_argument("--engine-address", help="also expose the engine core here for the ZMQ client library "
                                                 "(tcp://HOST:PORT or ipc://PATH)")
    parser.add_argument("--curve-key-file", help="CURVE key file for a tcp:// engine address (clients need it too)")
    parser.add_argument("--engine-insecure-loopback", action="store_true",
                        help="allow a tcp:// engine address on loopback without --curve-key-file: every user of "
                             "this host may then send it requests and privileged calls")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish on shutdown")
    dp_nodes.add_arguments(parser)
    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto")
    engine.add_argument("--max-model-len", type=int)
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="past this many waiting requests new ones get HTTP 429")
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--kv-cache-memory", help="bytes or a size like 4GiB")
    engine.add_argument("--encoder-cache-memory", help="image features kept by image hash: bytes or a size (1GiB)")
    engine.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="fp8 / fp8_e4m3 / fp8_e5m2: K and V in one byte each (twice the tokens per budget)")
    engine.add_argument("--kv-offload-bytes", help="host-memory tier of the prefix cache: bytes or a size like 8GiB")
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--tp", "--tensor-parallel-size", dest="tensor_parallel_size", type=int, default=1)
    engine.add_argument("--pp", "--pipeline-parallel-size", dest="pipeline_parallel_size", type=int, default=1)
    engine.add_argument("--dp", "--data-parallel-size", dest="data_parallel_size", type=int, default=1,
                        help="engine cores, each with its own scheduler, KV cache and workers, behind the gateways")
    engine.add_argument("--data-parallel-routing", choices=DP_ROUTING, default="prefix",
                        help="which engine takes a request: where its prompt prefix or cache_salt went unless that "
                             "one is overloaded ('prefix'), the least loaded ('load'), or in turn")
    engine.add_argument("--data-parallel-backend", choices=DP_BACKENDS, default="mp",
                        help="'ray': every engine's ranks are actors on the Ray cluster at --ray-address, each "
                             "engine in placement groups of its own")
    engine.add_argument("--quantization", choices=QUANTIZATION_METHODS,
                        help="int8, fp8: quantize the weights at load (one scale per output channel; fp8 "
                             "activations too on GPUs with fp8 tensor cores); compressed-tensors, gptq, awq, gguf: "
                             "the checkpoint's format (found without it)")
    engine.add_argument("--quantize-lm-head", action="store_true",
                        help="with --quantization: the LM head (and embeddings tied to it) too")
    engine.add_argument("--runner", choices=RUNNERS, default="auto",
                        help="pooling: embeddings, scores and classification only (the default for encoder-only "
                             "models like BERT); generate: a decoder serves generation and embedding requests")
    engine.add_argument("--pooler-config", metavar="JSON",
                        help='override the model\'s pooling, e.g. \'{"pooling_type": "MEAN", "normalize": false}\'')
    engine.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                        help="dummy: random weights of the config's shapes, no checkpoint read (benchmarking)")
    engine.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (--lora-modules, or loaded "
                                                                   "at run time with --allow-runtime-lora)")
    engine.add_argument("--max-loras", type=int, default=1, help="most distinct adapters in one step")
    engine.add_argument("--max-lora-rank", type=int, default=16)
    engine.add_argument("--max-cpu-loras", type=int, help="adapters kept loaded (default: --max-loras)")
    engine.add_argument("--enable-expert-parallel", action="store_true",
                        help="MoE models under --tp: divide whole experts among the ranks; with --dp > 1: among the "
                             "engines, which step together (docs/parallel.md)")
    engine.add_argument("--ray-address", help="with --tp/--pp > 1: join this Ray cluster ('auto' or HOST:6379; "
                                              "default: start a private Ray on this machine)")
    engine.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="auto: CUDA when torch sees a GPU, else CPU")
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="CUDA: fraction of the GPU's memory in use once the KV cache is allocated")
    engine.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode batches")
    engine.add_argument("--no-decode-ahead", dest="decode_ahead", action="store_false",
                        help="CUDA graphs: the GPU waits for the host between decode steps instead of starting the "
                             "next step's forward pass early")
    engine.add_argument("--num-scheduler-steps", type=int, default=64,
                        help="CPU: up to this many decode steps per worker call while nothing waits to join "
                             "(1: one call per step)")
    engine.add_argument("--multi-step-budget-ms", type=float, default=100.0,
                        help="CPU: ... and only as many as fit this long by recent steps' times (how long a "
                             "call holds its tokens back)")
    engine.add_argument("--cpu-threads", type=int,
                        help="CPU: threads of each rank's forward (default: the CPUs this process may use, one fewer "
                             "while another process competes for them)")
    engine.add_argument("--cpu-threads-bind", metavar="CPUS",
                        help="CPU: pin the forward's threads, one per CPU ('0-3,6'; one list per rank joined by '|')")
    engine.add_argument("--cuda-graph-sizes", type=int, nargs="+",
                        help="CUDA: decode batch sizes to capture (default 1 2 4 8 16 ... min(max-num-seqs, 512))")
    engine.add_argument("--profiler-dir", help="allow POST /start_profile and /stop_profile; traces go here only")
    engine.add_argument("--profiler-max-seconds", type=float, default=60.0,
                        help="a profile stops by itself (writing its trace) after this long (default: %(default)s)")
    engine.add_argument("--profiler-max-steps", type=int, default=200,
                        help="... or after this many engine steps (default: %(default)s)")
    engine.add_argument("--enable-cache-reset", action="store_true", help="allow POST /reset_prefix_cache")
    engine.add_argument("--enable-prompt-embeds", action="store_true",
                        help="take prompts as embeddings (/v1/completions' prompt_embeds: torch.save'd tensors, "
                             "loaded with weights_only=True)")
    engine.add_argument("--max-logprobs", type=int, default=20,
                        help="most top alternatives a request may ask for per token (default: %(default)s)")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="share KV blocks between requests by content (default: on)")
    engine.add_argument("--speculative-config", metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                             "(also prompt_lookup_min, prompt_lookup_max, disable_by_batch_size), or "
                             '\'{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}\'')
    engine.add_argument("--kv-transfer-config", metavar="JSON",
                        help='disaggregated prefill with --dp 2: \'{"kv_connector": "SharedMemoryConnector", '
                             '"kv_role": "kv_both", "kv_buffer_bytes": "256MiB"}\' (engine 0 prefills, 1 decodes; '
                             '"ZmqConnector" hands the KV over TCP at kv_ip:kv_port instead)')
    engine.add_argument("--structured-outputs-compile-timeout", type=float, default=10.0,
                        help="a request whose schema/regex/grammar takes longer to compile gets a 400 "
                        "(seconds, default: %(default)s)")
    engine.add_argument("--structured-outputs-compile-memory-mb", type=int, default=2048,
                        help="memory one grammar compile may use; past it the request gets a 400 "
                        "(MiB, default: %(default)s)")
    engine.add_argument("--structured-outputs-cache-mb", type=int, default=512,
                        help="compiled grammars kept for reuse, in MiB (default: %(default)s)")
    limits = parser.add_argument_group("request limits")
    limits.add_argument("--max-n", type=int, default=16)
    limits.add_argument("--max-stop", type=int, default=16)
    # These go to every gateway process as given; unset, the gateway's own default (in its --help) applies.
    add_gateway_flags(parser.add_argument_group("gateway (see python -m frontend.api.server --help)"),
                      pass_through=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["run-batch"]:  # as `vllm run-batch`; launch.run_batch imports this module, so not at the top
        from launch.run_batch import main as run_batch
        return run_batch(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv[1:] if argv[:1] == ["serve"] else argv)  # `serve` as in `vllm serve MODEL`
    if args.model_tag and args.model and args.model_tag != args.model:
        parser.error(f"two models: {args.model_tag!r} and --model {args.model!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        check_gateway_flags(args)
        model = args.model_tag or args.model or _demo_model(args)
        return Launcher(args, engine_config(args, model)).run()
    except (ValueError, TimeoutError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _demo_model(args: argparse.Namespace) -> str:
    """The shipped trained demo model; clients know it by a short name, not by its folder. Its chat template writes
    tool calls as hermes does, so `tools` with OpenAI's default tool_choice ("auto") are served, not a 400."""
    args.served_model_name = args.model_root = args.served_model_name or DEMO_MODEL_NAME
    if not getattr(args, "enable_auto_tool_choice", False):  # gateway flags are absent from args unless given
        args.enable_auto_tool_choice, args.tool_call_parser = True, getattr(args, "tool_call_parser", "hermes")
    return str(shipped_model("demo"))


def check_gateway_flags(args: argparse.Namespace) -> None:
    """ValueError for a gateway flag the gateways would refuse at start-up, before the engine is started."""
    if getattr(args, "chat_template", None) is not None:
        from frontend.tokenizer import load_chat_template  # loads transformers: only when asked

        load_chat_template(args.chat_template)
    mode = getattr(args, "generation_config", "auto")
    if mode not in ("auto", "vllm"):  # a folder the operator named: it must hold a readable generation_config.json
        from frontend.generation_config import load_generation_defaults

        load_generation_defaults("", mode)
    if getattr(args, "ssl_keyfile", None) and not getattr(args, "ssl_certfile", None):
        raise ValueError("--ssl-keyfile needs --ssl-certfile")
    auto_tool_parser(args)
    if (getattr(args, "lora_modules", None) or getattr(args, "allow_runtime_lora", False)) and not args.enable_lora:
        raise ValueError("--lora-modules and --allow-runtime-lora need --enable-lora")
    check_lora_flags(args)


def served_lora_dirs(args: argparse.Namespace) -> list[str] | None:
    """The folders the engine takes adapters from, whoever names them: each --lora-modules folder and, with
    --allow-runtime-lora, --lora-dir (None without --enable-lora)."""
    if not args.enable_lora:
        return None
    folders = list(parse_lora_modules(getattr(args, "lora_modules", None)).values())
    return folders + [args.lora_dir] if getattr(args, "allow_runtime_lora", False) else folders


def engine_config(args: argparse.Namespace, model: str) -> EngineConfig:
    """The engine group's flags as an EngineConfig (ValueError naming a bad one)."""
    return EngineConfig(model=model, dtype=args.dtype, max_model_len=args.max_model_len,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_waiting_requests=args.max_waiting_requests, block_size=args.block_size,
                        kv_cache_memory=args.kv_cache_memory, encoder_cache_memory=args.encoder_cache_memory,
                        kv_cache_dtype=args.kv_cache_dtype, kv_offload_bytes=args.kv_offload_bytes,
                        seed=args.seed,
                        tensor_parallel_size=args.tensor_parallel_size,
                        pipeline_parallel_size=args.pipeline_parallel_size,
                        data_parallel_size=args.data_parallel_size, data_parallel_routing=args.data_parallel_routing,
                        data_parallel_backend=args.data_parallel_backend,
                        enable_expert_parallel=args.enable_expert_parallel, quantization=args.quantization,
                        quantize_lm_head=args.quantize_lm_head, load_format=args.load_format,
                        ray_address=args.ray_address,
                        enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                        max_cpu_loras=args.max_cpu_loras, lora_dirs=served_lora_dirs(args),
                        device=args.device, gpu_memory_utilization=args.gpu_memory_utilization,
                        enforce_eager=args.enforce_eager, cuda_graph_sizes=args.cuda_graph_sizes,
                        decode_ahead=args.decode_ahead, num_scheduler_steps=args.num_scheduler_steps,
                        multi_step_budget_ms=args.multi_step_budget_ms, cpu_threads=args.cpu_threads,
                        cpu_threads_bind=args.cpu_threads_bind,
                        profiler_dir=args.profiler_dir, profiler_max_seconds=args.profiler_max_seconds,
                        profiler_max_steps=args.profiler_max_steps, enable_cache_reset=args.enable_cache_reset,
                        max_logprobs=args.max_logprobs, enable_prefix_caching=args.enable_prefix_caching,
                        tokenizer=getattr(args, "tokenizer", None),
                        structured_outputs_compile_timeout=args.structured_outputs_compile_timeout,
                        structured_outputs_compile_memory_mb=args.structured_outputs_compile_memory_mb,
                        structured_outputs_cache_mb=args.structured_outputs_cache_mb,
                        speculative_config=args.speculative_config, kv_transfer_config=args.kv_transfer_config,
                        runner=args.runner,
                        pooler_config=args.pooler_config, enable_prompt_embeds=args.enable_prompt_embeds)


if __name__ == "__main__":
    sys.exit(main())
