"""Each family and weight format the other fast-path tests do not count takes the fast path through the engine:
its prompts and first steps in the C++ decoder layer, a multi-step call's later steps in one C++ call
(kernels.cpu_greedy_decode). Counted, as the GPU tests count the GEMV's: a silent fallback to the op path fails."""
from __future__ import annotations

import pytest

from conftest import tiny_model
from frontend import LLM, SamplingParams
from kernels import cpu_decoder_layer, cpu_greedy_decode
from test_gguf import COMMITTED, COMMITTED_FILE

# test_multi_step counts llama, gemma2, gpt_neox, qwen2_moe and opt and each request feature; test_cpu_mla_layer
# deepseek_v3; test_gemma3 gemma3_text; test_lora the adapters; test_cpu_int4 and test_fp8_blocks their formats.
CASES = {"qwen2": ("qwen2", {}), "mistral": ("mistral", {}), "qwen3": ("qwen3", {}), "phi3": ("phi3", {}),
         "mixtral": ("mixtral", {}), "qwen3_moe": ("qwen3_moe", {}), "deepseek_v2": ("deepseek_v2", {}),
         "int8 weights": ("llama", {"quantization": "int8"}), "GGUF Q8_0": (None, {"tokenizer": str(COMMITTED)})}


@pytest.mark.parametrize("case", CASES)
def test_the_engine_runs_it_in_the_cpp_layer_and_one_cpp_call_a_call(case, monkeypatch):
    arch, engine_args = CASES[case]
    layer_calls, whole_calls = [], []
    layers, greedy = cpu_decoder_layer.decoder_layers, cpu_greedy_decode.greedy_decode
    monkeypatch.setattr(cpu_decoder_layer, "decoder_layers", lambda *args: layer_calls.append(1) or layers(*args))
    monkeypatch.setattr(cpu_greedy_decode, "greedy_decode", lambda *args: whole_calls.append(1) or greedy(*args))
    llm = LLM(COMMITTED_FILE if arch is None else tiny_model(arch), in_process=True, dtype="float32",
              num_scheduler_steps=8, multi_step_budget_ms=None, **engine_args)
    try:
        [output] = llm.generate([{"prompt_token_ids": list(range(3, 20))}],
                                SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert len(output.outputs[0].token_ids) == 17
    assert layer_calls, "the engine never took the C++ decoder layer"
    # 17 tokens: the prompt's step gives one, then calls of 8 steps whose first is the C++ layer's, the rest one call
    assert len(whole_calls) >= 2, f"later steps in one C++ call {len(whole_calls)} times"
