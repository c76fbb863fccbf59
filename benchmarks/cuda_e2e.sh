#!/usr/bin/env bash
# Issue 26's checks on one CUDA GPU, each step bounded in time so that one hang leaves the rest their turn:
# the CUDA and Triton tests, then the stages of benchmarks/cuda_e2e.py on an 8B-shaped model; then the tests and
# benchmarks of speculative decoding, LoRA, quantization and MoE on the GPU.
#   bash benchmarks/cuda_e2e.sh OUT_DIR [STEP ...]    steps: tests graph-tests batch1 batch1-noahead batch1-cublas
#                                                      batch1-int8 batch1-moe eager kernels gemv-tests overhead
#                                                      overhead-noahead overhead1 throughput roofline hf later-tests
#                                                      later-bench (= moe-bench spec-bench lora-bench quant-bench)
#                                                      (default: all)
# CUDA_E2E_DEADLINE=SECONDS: a step gets at most what is left of them (a lease's end), and none starts with
# under 20 s left. Results: OUT_DIR/results.jsonl (one JSON line per figure), OUT_DIR/log.txt,
# OUT_DIR/pytest_kernels.txt.
set -u
out=${1:?usage: cuda_e2e.sh OUT_DIR [STEP ...]}
shift
steps=${*:-tests graph-tests batch1 batch1-noahead batch1-cublas batch1-int8 batch1-moe eager kernels overhead
overhead-noahead overhead1 throughput roofline hf later-tests later-bench}
deadline=${CUDA_E2E_DEADLINE:-0}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
model=${PAGEDSERVE_8B_MODEL:-/tmp/llama3-8b}
bench=(python3 benchmarks/cuda_e2e.py --model "$model" --results "$out/results.jsonl")
# A mixture of experts at batch 1: Qwen3-30B-A3B's shapes (48 layers, 128 experts of 768, 8 a token), random weights.
moe_e2e=(python3 benchmarks/cuda_e2e.py --model /tmp/qwen3-30b-a3b --results "$out/results.jsonl")
qwen3_30b_a3b='{"hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
 "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
 "num_experts_per_tok": 8, "vocab_size": 151936, "max_position_embeddings": 8192}'
# Those four benchmarks at sizes that take about 150 s together on an H100 (later-bench: all four, the cheapest first).
moe_bench=(python3 benchmarks/moe.py --device cuda --num-requests 16 --input-len 32 128 --output-len 16 64
  --hf-batch-size 16 --layer-rounds 10)
spec_bench=(python3 benchmarks/spec_decode.py --device cuda --requests 2 --batch 16 --max-tokens 64 --rounds 2)
lora_bench=(python3 benchmarks/lora.py --device cuda --requests 16 --prompt-tokens 64 --output-tokens 32 --rounds 2)
quant_bench=(python3 benchmarks/quant.py --device cuda --windows 4 --decode-tokens 64 --rounds 2 --batch 16)

step() {  # step SECONDS NAME COMMAND...: run it under a time limit, its output in the log
  local limit=$1 name=$2 start=$SECONDS
  shift 2
  if ((deadline > 0)); then
    ((deadline - SECONDS < 20)) && { echo "=== $name: skipped, the deadline is near" | tee -a "$out/log.txt"; return; }
    ((limit > deadline - SECONDS)) && limit=$((deadline - SECONDS))
  fi
  echo "=== $name (limit ${limit}s)" | tee -a "$out/log.txt"
  timeout -k 10 "$limit" "$@" >>"$out/log.txt" 2>&1
  echo "=== $name: exit $? after $((SECONDS - start))s" | tee -a "$out/log.txt"
}

steps_of_later() {  # steps_of_later moe|spec|lora|quant
  local -n command=${1}_bench
  step 90 "$1-bench" "${command[@]}"
}

nvidia-smi -L | tee -a "$out/log.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/log.txt"
# The tests' session fixture loads the C++ CPU kernels: build them meanwhile, on a core the GPU work leaves idle.
nice -n 19 python3 -c "from kernels import cpu_extension; cpu_extension.load()" >"$out/cpu_build.txt" 2>&1 &
made=0
model_made() {  # the 8B-shaped model, before the first step that runs it
  ((made)) || step 60 make "${bench[@]}" make
  made=1
}
for s in $steps; do
  case $s in
    tests) wait  # the kernel tests beside the engine's: all only check results
           python3 -m pytest -q -p no:cacheprovider --timeout 120 -rs tests/test_triton_kernels.py \
             tests/test_decode_ahead.py >"$out/pytest_kernels.txt" 2>&1 &
           # The test models first: four workers would otherwise each write them. The KV-budget test reads the
           # GPU's free memory, so it runs alone. Each engine on a GPU times the GEMV at start-up, and the first
           # on a machine compiles its launch shapes: the limits leave room for that.
           python3 -c "import sys; sys.path.insert(0, 'tests'); from conftest import tiny_model; \
             [tiny_model(arch) for arch in ('llama', 'qwen2')]" >>"$out/log.txt" 2>&1
           step 260 tests python3 -m pytest -q -p no:cacheprovider --timeout 120 -rs -n 4 -k "not kv_budget" \
             tests/test_cuda.py
           step 120 tests-kv-budget python3 -m pytest -q -p no:cacheprovider --timeout 110 -k kv_budget \
             tests/test_cuda.py
           wait; tail -3 "$out/pytest_kernels.txt" | tee -a "$out/log.txt" ;;
    graph-tests) wait  # the CPU kernels built
           # Features inside the graphs (issue 58): MoE and LoRA decode by counted replays and stay exact; the
           # kernels' twins and capture-safety checks natively.
           step 300 graph-tests python3 -m pytest -q -p no:cacheprovider --timeout 150 -rs \
             tests/test_cuda_graph_features.py tests/test_graph_safe_kernels.py ;;
    batch1) model_made; step 140 batch1-graphs "${bench[@]}" batch1 ;;  # the GEMV's timing and compiles: 140 s
    batch1-noahead) model_made; step 100 batch1-graphs-noahead "${bench[@]}" batch1 --no-decode-ahead ;;
    batch1-cublas) model_made; step 100 batch1-graphs-cublas "${bench[@]}" batch1 --triton-gemv off ;;
    batch1-int8) model_made; step 120 batch1-int8 "${bench[@]}" batch1 --quantization int8 ;;
    batch1-moe) step 60 make-moe "${moe_e2e[@]}" make --arch qwen3_moe --overrides "$qwen3_30b_a3b"
           step 150 batch1-moe "${moe_e2e[@]}" batch1 ;;
    gemv-tests) wait  # the CPU kernels built (the tests' session fixture loads them)
           step 150 gemv-tests python3 -m pytest -q -p no:cacheprovider --timeout 120 -rs -k gemv \
             tests/test_triton_kernels.py tests/test_cuda.py ;;
    eager) model_made; step 80 batch1-eager "${bench[@]}" batch1 --enforce-eager ;;
    kernels) step 60 kernels python3 benchmarks/kernels.py ;;
    overhead) model_made; step 120 overhead "${bench[@]}" overhead --num-requests 256 --host-profile ;;
    overhead-noahead) model_made; step 120 overhead-noahead "${bench[@]}" overhead --num-requests 256 --no-decode-ahead ;;
    overhead1) model_made; step 60 overhead-batch1 "${bench[@]}" overhead --num-requests 1 --host-profile ;;
    throughput) model_made; step 150 throughput "${bench[@]}" throughput --num-requests 1000 ;;
    roofline) model_made; step 240 roofline "${bench[@]}" roofline --num-requests 1000 ;;
    hf) model_made; step 120 hf "${bench[@]}" hf --num-requests 256 ;;
    later-tests) wait  # the CPU kernels built
           # One worker: engines that size their KV cache by gpu_memory_utilization count each other's as used.
           # About 8-10 minutes on an H100 (each engine profiles its memory and captures graphs): a call of its own.
           # CUDA_E2E_LATER_TESTS narrows the files (a call that resumes where the last one stopped).
           step 560 later-tests python3 -m pytest -q -p no:cacheprovider --timeout 120 -rs \
             ${CUDA_E2E_LATER_TESTS:-tests/test_spec_decode.py tests/test_lora.py tests/test_quantization.py \
             tests/test_fused_moe.py} ;;
    later-bench) for b in moe spec lora quant; do steps_of_later "$b"; done ;;
    moe-bench|spec-bench|lora-bench|quant-bench) steps_of_later "${s%-bench}" ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
grep -h "^=== \|passed\|failed\|Error" "$out/log.txt" | tail -40
sed -n '/^=== kernels (/,/^=== kernels:/p' "$out/log.txt"
cat "$out/results.jsonl" 2>/dev/null
