"""Features inside CUDA graphs, skipped only where torch sees no GPU: a mixture of experts and LoRA adapters decode
by replaying the captured graphs (counted: no silent fall-back to eager steps) and give the tokens they give
without graphs (the CPU's for the MoE model, HF + PEFT's for the adapters)."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_all_blocks_free, random_prompts, tiny_model
from frontend import LLM
from test_cuda import SMALL_CACHE, model_runner
from test_hf_exactness import GREEDY
from test_lora import ADAPTERS, lora, peft_greedy
from test_lora import GREEDY as LORA_GREEDY

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GRAPH_SIZES = [1, 2, 4, 8]


def count_replays(monkeypatch, llm: LLM) -> list[int]:
    """The sizes of the graphs the engine replays from now on (decode ahead's replays included)."""
    graphs = model_runner(llm).decode_graphs
    assert graphs is not None and sorted(graphs.graphs) == GRAPH_SIZES
    replayed: list[int] = []
    replay = graphs.replay
    monkeypatch.setattr(graphs, "replay", lambda size: replayed.append(size) or replay(size))
    return replayed


def test_mixture_of_experts_decodes_in_graphs_and_equals_the_cpu(monkeypatch):
    """The routing sorted on the device and the experts' grids fixed by the captured size: float32 greedy tokens
    equal the CPU's while batches of 3 to 1 replay the graphs."""
    model_dir = tiny_model("mixtral")
    prompts = [{"prompt_token_ids": p} for p in random_prompts([7, 30, 12], vocab=1000, seed=5)]
    tokens, replayed = {}, []
    for device in ("cpu", "cuda"):
        llm = LLM(model_dir, device=device, dtype="float32", in_process=True, max_model_len=256,
                  cuda_graph_sizes=GRAPH_SIZES, **SMALL_CACHE)
        if device == "cuda":
            replayed = count_replays(monkeypatch, llm)
        tokens[device] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert_all_blocks_free(llm)
        llm.shutdown()
    assert tokens["cuda"] == tokens["cpu"]
    assert len(replayed) >= GREEDY.max_tokens - 1 and set(replayed) <= {4}


def test_lora_adapters_decode_in_graphs_and_equal_peft(monkeypatch):
    """Three adapters (one with its own embeddings and LM head) and the base model at max_loras=2, so slots are
    swapped between steps: decode steps replay the graphs captured once, with any mix of slots, and every request
    equals HF + PEFT. Steps holding the adapter with its own embeddings run eagerly."""
    names = [None, *ADAPTERS]
    prompts = random_prompts([5, 40, 17, 33, 9, 21, 12, 28], vocab=1000)
    requests = [(p, names[i % len(names)]) for i, p in enumerate(prompts)]
    ids = {name: i + 1 for i, name in enumerate(ADAPTERS)}
    llm = LLM(tiny_model("llama"), device="cuda", dtype="float32", in_process=True, enable_lora=True, max_loras=2,
              max_lora_rank=8, max_model_len=256, cuda_graph_sizes=GRAPH_SIZES, **SMALL_CACHE)
    try:
        replayed = count_replays(monkeypatch, llm)
        graphs = dict(model_runner(llm).decode_graphs.graphs)
        outputs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], LORA_GREEDY, use_tqdm=False,
                               lora_request=[None if n is None else lora(n, ids[n]) for _, n in requests])
        for (prompt, name), output in zip(requests, outputs):
            assert output.outputs[0].token_ids == peft_greedy(name, prompt, LORA_GREEDY.max_tokens), name
        assert replayed, "no decode step replayed a graph"
        assert model_runner(llm).decode_graphs.graphs == graphs, "graphs captured once serve every mix of slots"
        # Adapted requests alone (no base-model row in the batch): still in the graphs.
        adapted = [(p, n) for p, n in requests if n == "everything-r8-rslora"]
        before = len(replayed)
        outputs = llm.generate([{"prompt_token_ids": p} for p, _ in adapted], LORA_GREEDY, use_tqdm=False,
                               lora_request=[lora(n, ids[n]) for _, n in adapted])
        for (prompt, name), output in zip(adapted, outputs):
            assert output.outputs[0].token_ids == peft_greedy(name, prompt, LORA_GREEDY.max_tokens)
        assert len(replayed) - before >= LORA_GREEDY.max_tokens - 1
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()
