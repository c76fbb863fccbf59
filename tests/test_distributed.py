"""tp × pp on Ray actors (gloo, loopback): greedy float32 outputs equal one rank's, also across two Ray nodes;
a killed worker ends every pending request with an error and leaves nothing behind."""
from __future__ import annotations

import functools
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

# Ray turns a 127.0.0.1 cluster address into this machine's outward IP unless told that the machine's IP is
# loopback (read when ray is imported, inherited by the engine and Ray processes): all of it stays on 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
import ray  # noqa: E402  (a base dependency: missing, the tests must fail, not skip)
from ray.cluster_utils import Cluster  # noqa: E402

from conftest import random_prompts, tiny_model, wait_until  # noqa: E402
from launcher import descendants  # noqa: E402
from frontend import LLM, EngineDeadError, SamplingParams, StructuredOutputsParams  # noqa: E402
from launch.make_model import make_model  # noqa: E402
from ipc import SchedulerStats  # noqa: E402

PROMPT_LENGTHS = [3, 20, 45, 70]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# 16 blocks of 8 tokens hold 128 of the ~180 tokens the prompts need: requests get preempted; 16-token steps
# split every longer prompt into chunks.
SMALL_ENGINE = {"dtype": "float32", "block_size": 8, "num_kv_blocks": 16, "max_model_len": 128,
                "max_num_batched_tokens": 16}
CPUS_PER_NODE = 2


@functools.cache
def model_dir(name: str) -> str:
    """'qwen2' (4 heads, 2 KV heads, tied embeddings, q/k/v biases), 'qwen3', 'mixtral', 'deepseek_v2', 'deepseek_v3',
    'llama-kv1' (4 heads sharing one KV head: with tp=2 both ranks hold a copy of it) or 'opt-proj' (random biases
    on every linear and norm, learned positions, tied embeddings narrower than the hidden size: project_in on the
    first stage, project_out on the last)."""
    if name in ("qwen2", "qwen3", "mixtral", "deepseek_v2", "deepseek_v3"):
        return tiny_model(name)
    if name == "opt-proj":
        folder = Path(tiny_model("opt")).parent / "opt-tiny-proj"
        return str(make_model(folder, arch="opt", size="tiny", random_biases=True, word_embed_proj_dim=32))
    folder = Path(tiny_model("llama")).parent / "llama-tiny-kv1"
    return str(make_model(folder, arch="llama", size="tiny", num_key_value_heads=1))


# Seed 0's second prompt meets a near tie in the tiny Mixtral (top two logits 5e-6 apart at its 10th token: HF and a
# pipeline run pick one, a single rank the other): greedy exactness there says nothing, so it gets other prompts.
PROMPT_SEEDS = {"mixtral": 1}


@functools.cache
def single_rank_outputs(name: str) -> tuple[list[list[int]], list[list[int]]]:
    prompts = random_prompts(PROMPT_LENGTHS, vocab=1000, seed=PROMPT_SEEDS.get(name, 0))
    return prompts, generate(LLM(model_dir(name), dtype="float32", in_process=True), prompts)


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def cluster():
    """Two Ray "nodes" of 2 CPUs each on loopback; this process is connected to it as a driver."""
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": CPUS_PER_NODE, "include_dashboard": False, "node_ip_address": "127.0.0.1"})
    cluster.add_node(num_cpus=CPUS_PER_NODE, node_ip_address="127.0.0.1")
    ray.init(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def stage_nodes() -> dict[int, set[str]]:
    """Pipeline stage → node ids of its placement group's bundles, for the one live engine's groups."""
    groups = [group for group in ray.util.placement_group_table().values() if group["state"] == "CREATED"]
    return {int(group["name"].rsplit("-pp", 1)[1]): set(group["bundles_to_node_id"].values()) for group in groups}


SLOW = pytest.mark.slow


# Each family and each layout once by default, each family where its parts split: llama-kv1's one KV head copied
# at tp 2, qwen2's tied table on the first and last stage at pp 2 (its q/k/v biases under tp: the int8 and
# data-parallel cases), opt-proj's row-parallel biases and project_in/out at tp 2 x pp 2; the other six are slow.
DEFAULT_LAYOUTS = {"llama-kv1": (2, 1), "qwen2": (1, 2), "opt-proj": (2, 2)}


@pytest.mark.parametrize("name, tp, pp", [
    (name, tp, pp) if DEFAULT_LAYOUTS[name] == (tp, pp) else pytest.param(name, tp, pp, marks=SLOW)
    for name in DEFAULT_LAYOUTS for tp, pp in ((2, 1), (1, 2), (2, 2))])
def test_parallel_equals_single_rank(cluster, name, tp, pp):
    """Chunked and preempted; tp × pp runs in this process on the two-node cluster (each stage on one node)."""
    prompts, expected = single_rank_outputs(name)
    llm = LLM(model_dir(name), in_process=True, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              **SMALL_ENGINE)
    try:
        assert generate(llm, prompts) == expected
        assert llm.get_stats().num_preemptions > 0
        if pp == 2:
            nodes = stage_nodes()
            assert all(len(nodes[stage]) == 1 for stage in range(pp)), nodes
            if tp == 2:
                assert nodes[0] != nodes[1], "stages should fill one node each"
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name, tp, pp, expert_parallel", [
    # Mixtral's experts split by TP by default, DeepSeek-V3's handed out whole (expert parallel).
    ("mixtral", 2, 1, False), pytest.param("mixtral", 2, 1, True, marks=SLOW),
    pytest.param("mixtral", 1, 2, False, marks=SLOW),
    ("qwen3", 2, 1, False), pytest.param("qwen3", 1, 2, False, marks=SLOW),
    pytest.param("deepseek_v2", 2, 1, True, marks=SLOW), ("deepseek_v3", 2, 1, True), ("deepseek_v2", 2, 1, False)])
def test_families_parallel_equal_single_rank(cluster, name, tp, pp, expert_parallel):
    """Mixtral's experts split by their intermediate dimension (TP) or handed out whole (expert parallel),
    Qwen3's per-head q/k norms under TP and PP, DeepSeek-V2/V3's latent cache (whole on every rank, its heads split)
    with experts split by TP (the C++ layers' sums over the group) or V3's biased expert choice with experts handed
    out whole: outputs equal one rank's."""
    prompts, expected = single_rank_outputs(name)
    llm = LLM(model_dir(name), in_process=True, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              enable_expert_parallel=expert_parallel, **SMALL_ENGINE)
    try:
        assert generate(llm, prompts) == expected
    finally:
        llm.shutdown()


def test_int8_quantized_parallel_equals_single_rank(cluster):
    """Row-parallel layers take each row's scale from the whole row (max over the TP ranks), and a tied table is
    quantized on the first stage (embeddings) as on the last (head): int8 tp × pp computes what int8 on one rank
    does."""
    quantized = {"quantization": "int8", "quantize_lm_head": True}
    prompts = random_prompts(PROMPT_LENGTHS, vocab=1000)
    expected = generate(LLM(model_dir("qwen2"), dtype="float32", in_process=True, **quantized), prompts)
    llm = LLM(model_dir("qwen2"), in_process=True, tensor_parallel_size=2, pipeline_parallel_size=2, **quantized,
              **SMALL_ENGINE)
    try:
        assert generate(llm, prompts) == expected
        assert llm.info.weight_bytes > 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["gptq-4bit-act-order", pytest.param("ct-w4a16-asymmetric", marks=pytest.mark.slow),
                                  pytest.param("gguf-q8_0", marks=pytest.mark.slow)])
def test_quantized_checkpoint_parallel_equals_single_rank(cluster, kind):
    """Packed 4-bit weights split over the ranks in whole bytes and groups (row-parallel layers take their columns'
    share of the scales and zero points; with act-order, the whole scales and their columns' g_idx); GGUF's Q8_0
    rows and llama's reordered q/k rows split like any others."""
    from test_gguf import COMMITTED, COMMITTED_FILE
    from quantized_checkpoints import checkpoint

    model, extra = (COMMITTED_FILE, {"tokenizer": str(COMMITTED)}) if kind == "gguf-q8_0" else \
        (checkpoint(kind, "qwen2")[0], {})
    prompts = random_prompts(PROMPT_LENGTHS, vocab=1000)
    expected = generate(LLM(model, dtype="float32", in_process=True, **extra), prompts)
    llm = LLM(model, in_process=True, tensor_parallel_size=2, **SMALL_ENGINE, **extra)
    try:
        assert generate(llm, prompts) == expected
    finally:
        llm.shutdown()


@pytest.mark.parametrize("tp, pp", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)])
def test_lora_parallel_equals_single_rank(cluster, tp, pp):
    """Column-parallel layers hold their rows of B, row-parallel ones their columns of A (the delta summed with
    the products); an adapter's own LM head and embeddings are whole on every rank that uses them; pipeline stages
    hold the adapter's modules of their own layers."""
    from test_lora import ADAPTERS, lora

    prompts = random_prompts(PROMPT_LENGTHS, vocab=1000)
    adapters = [None, *(lora(name, i + 1) for i, name in enumerate(ADAPTERS))]  # one per prompt
    engine = {"enable_lora": True, "max_loras": 3, "max_lora_rank": 8}

    def run(llm: LLM) -> list[list[int]]:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                               lora_request=adapters)
        return [o.outputs[0].token_ids for o in outputs]

    single = LLM(tiny_model("llama"), dtype="float32", in_process=True, **engine)
    try:
        expected = run(single)
    finally:
        single.shutdown()
    llm = LLM(tiny_model("llama"), in_process=True, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              **SMALL_ENGINE, **engine)
    try:
        assert run(llm) == expected
    finally:
        llm.shutdown()


MULTI_STEP_PROMPTS = random_prompts([5, 20, 9], vocab=1000, seed=7)
MULTI_STEP_PARAMS = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
                     SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=2),
                     SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, presence_penalty=0.5, logprobs=0)]


def multi_step_run(steps: int, **layout) -> tuple[list, int]:
    """The MULTI_STEP requests' completions from an in-process LLM of tiny llama (float32) taking up to `steps` decode
    steps a call, and how many engine steps (calls) they took."""
    llm = LLM(tiny_model("llama"), in_process=True, dtype="float32", block_size=8, max_model_len=128,
              num_scheduler_steps=steps, multi_step_budget_ms=None, **layout)
    calls, step = [], llm.client.engine.step
    llm.client.engine.step = lambda: calls.append(1) or step()
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in MULTI_STEP_PROMPTS], MULTI_STEP_PARAMS,
                               use_tqdm=False)
        return [o.outputs[0] for o in outputs], len(calls)
    finally:
        llm.shutdown()


@functools.cache
def one_call_per_step() -> tuple[list, int]:
    """multi_step_run at one rank, one step a call: the reference."""
    return multi_step_run(1)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), pytest.param(2, 2, marks=SLOW)])
def test_multi_step_calls_over_ranks_equal_one_rank(cluster, tp, pp):
    """Every rank runs a call's later steps: each stage hands the next its hidden states, and the driver's tokens of
    each step reach every rank (a sum over the TP group in one stage, a broadcast over stages). Greedy, seeded sampled,
    penalized and logprob requests get one rank's tokens and logprobs of one call per step, in fewer engine steps."""
    (multi, multi_calls), (single, single_calls) = multi_step_run(8, tensor_parallel_size=tp,
                                                                  pipeline_parallel_size=pp), one_call_per_step()
    assert multi_calls < single_calls / 2, (multi_calls, single_calls)
    for got, expected in zip(multi, single, strict=True):
        assert got.token_ids == expected.token_ids
        for got_step, expected_step in zip(got.logprobs or [], expected.logprobs or [], strict=True):
            assert got_step.keys() == expected_step.keys()
            for token, logprob in got_step.items():
                assert logprob.logprob == pytest.approx(expected_step[token].logprob, abs=1e-5)


@pytest.mark.parametrize("tp, pp", [(2, 1), pytest.param(2, 2, marks=SLOW)])
def test_ranks_fall_back_to_zmq_without_shared_memory(cluster, monkeypatch, tp, pp):
    """As for ranks on another host than the engine: steps and replies go over ZMQ instead of shared memory (at
    tp 2 x pp 2, the last stage's driver, rank 2, replies)."""
    import workers.ray_executor

    refused = []

    def refuse(paths) -> None:
        refused.append(paths)

    monkeypatch.setattr(workers.ray_executor, "create_channel", refuse)
    prompts, expected = single_rank_outputs("llama-kv1")
    llm = LLM(model_dir("llama-kv1"), in_process=True, tensor_parallel_size=tp, pipeline_parallel_size=pp,
              **SMALL_ENGINE)
    try:
        assert generate(llm, prompts) == expected
        assert len(refused) == 2  # the step and the reply channel
    finally:
        llm.shutdown()


def test_data_parallel_engines_take_a_node_each(cluster):
    """--dp 2 --data-parallel-backend ray, tp 2: each engine process joins the cluster with placement groups of its
    own names, Ray puts them on different nodes (2 CPUs each), and both answer as one rank does."""
    prompts, expected = single_rank_outputs("qwen2")
    llm = LLM(model_dir("qwen2"), tensor_parallel_size=2, data_parallel_size=2, data_parallel_backend="ray",
              ray_address=cluster.address, data_parallel_routing="round_robin", **SMALL_ENGINE)
    try:
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
        assert len({g["name"] for g in groups}) == 2, groups
        nodes = [set(g["bundles_to_node_id"].values()) for g in groups]
        assert all(len(n) == 1 for n in nodes) and nodes[0] != nodes[1]
        assert generate(llm, prompts) == expected
        assert all(client.get_stats().prefix_cache_queries > 0 for client in llm.client.clients)  # both served
    finally:
        llm.shutdown()


def test_private_ray_when_no_address():
    """Without ray_address the engine process starts its own loopback Ray, and stops it on shutdown."""
    prompts, expected = single_rank_outputs("llama-kv1")
    llm = LLM(model_dir("llama-kv1"), tensor_parallel_size=2, **SMALL_ENGINE)
    try:
        assert generate(llm, prompts) == expected
        ray_pids = [pid for pid, command in descendants(llm.client.process.pid)
                    if "gcs_server" in command or "raylet" in command]
        assert ray_pids  # the engine process's own Ray (not the module's test cluster)
    finally:
        llm.shutdown()
    assert wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in ray_pids), timeout=30)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a cluster without GPUs")
def test_cuda_ranks_on_a_cluster_without_gpus_are_refused_at_once(cluster):
    start = time.monotonic()
    with pytest.raises(ValueError, match="needs 2 GPUs; the Ray cluster has 0"):
        LLM(model_dir("qwen2"), device="cuda", tensor_parallel_size=2, ray_address=cluster.address)
    assert time.monotonic() - start < 30  # not the placement timeout
    assert wait_until(lambda: not stage_nodes(), timeout=10), stage_nodes()


def test_killed_worker_fails_pending_requests(cluster):
    llm = LLM(model_dir("qwen2"), dtype="float32", tensor_parallel_size=2, ray_address=cluster.address)
    errors: list[Exception] = []
    long_run = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)

    def run() -> None:
        try:
            llm.generate([{"prompt_token_ids": p} for p in random_prompts([5] * 8, vocab=1000)], long_run,
                         use_tqdm=False)
        except Exception as error:
            errors.append(error)

    generating = threading.Thread(target=run)
    generating.start()
    try:
        # The 8 requests' 900 steps took 2.0 s here: 0.3 s in, they are mid-generation on a machine several times
        # faster (a kill after they finished would test nothing, hence the check).
        time.sleep(0.3)
        assert generating.is_alive() and len(rank_pids()) == 2
        os.kill(rank_pids()[0], signal.SIGKILL)
        killed = time.monotonic()
        generating.join(timeout=10)
        assert not generating.is_alive() and time.monotonic() - killed < 5
        assert len(errors) == 1 and isinstance(errors[0], EngineDeadError), errors
        assert "worker rank" in str(errors[0])
        assert wait_until(lambda: not rank_pids(), timeout=10), rank_pids()
        assert wait_until(lambda: not stage_nodes(), timeout=10), stage_nodes()
        assert wait_until(lambda: ray.available_resources().get("CPU") == 2 * CPUS_PER_NODE, timeout=10)
    finally:
        llm.shutdown()


def rank_pids() -> list[int]:
    """Processes whose title Ray set to a RankWorker actor's."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().startswith(b"ray::RankWorker"):
                pids.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return pids


def _completions(prompts: list[dict], params: SamplingParams, **engine_args) -> tuple[list, SchedulerStats]:
    """Each prompt's completion from an in-process LLM of the llama-kv1 model, and the engine's stats after them."""
    llm = LLM(model_dir("llama-kv1"), in_process=True, **engine_args)
    try:
        outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return outputs, llm.get_stats()
    finally:
        llm.shutdown()


def test_constrained_outputs_under_tp_and_pp_equal_one_ranks(cluster):
    """The step's grammar bitmask reaches the rank that samples: tp=2 x pp=2 writes one rank's constrained text."""
    pattern = "[a-z]{3,6}-[0-9]{2}"
    params = SamplingParams(temperature=0.0, max_tokens=16,
                            structured_outputs=StructuredOutputsParams(regex=pattern))
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 30, 60], vocab=1000)]
    expected = [o.text for o in _completions(prompts, params, dtype="float32")[0]]
    texts = [o.text for o in _completions(prompts, params, tensor_parallel_size=2, pipeline_parallel_size=2,
                                          **SMALL_ENGINE)[0]]
    assert texts == expected and all(re.fullmatch(pattern, text) for text in texts), (texts, expected)


@pytest.mark.parametrize("method", ["ngram", pytest.param("draft_model", marks=SLOW)])
def test_speculative_decoding_under_tp_and_pp_equals_one_rank(cluster, method):
    """Every rank builds the step's input from the drafts the scheduler sends; the last stage's driver verifies them
    and proposes the next ones (with a draft model it holds whole, here the target itself): tp=2 x pp=2 writes one
    rank's greedy tokens."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2} \
        if method == "ngram" else {"method": method, "model": model_dir("llama-kv1"), "num_speculative_tokens": 3}
    spec["disable_by_batch_size"] = None  # all three requests speculate
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # Repeated short patterns: this random model's greedy output runs into loops that prompt lookup partly predicts.
    prompts = [{"prompt_token_ids": p * 8} for p in random_prompts([3, 4, 5], vocab=1000)]
    expected = [o.token_ids for o in _completions(prompts, params, dtype="float32")[0]]
    outputs, stats = _completions(prompts, params, tensor_parallel_size=2, pipeline_parallel_size=2,
                                  speculative_config=spec, **{**SMALL_ENGINE, "num_kv_blocks": 40})
    stats = stats.spec_decoding
    assert [o.token_ids for o in outputs] == expected
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens, stats
    if method == "ngram":
        assert stats.num_accepted_tokens < stats.num_draft_tokens


@pytest.mark.parametrize("method, tp, pp", [("ngram", 2, 1), ("ngram", 1, 2), ("draft_model", 2, 1),
                                             ("draft_model", 1, 2)])
def test_speculative_multi_step_calls_over_ranks_equal_one_rank(cluster, method, tp, pp):
    """A call's later steps verify drafts inside the one C++ call at every rank: the driver drafts (prompt lookup, or
    the draft model it holds whole: here the target itself) and chooses, the other ranks take its tokens. Greedy and
    seeded sampled requests get one rank's tokens and the same drafts drafted and accepted, in fewer engine steps
    than steps."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2} \
        if method == "ngram" else {"method": method, "model": model_dir("llama-kv1"), "num_speculative_tokens": 3}
    spec["disable_by_batch_size"] = None
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)]
    prompts = [{"prompt_token_ids": p * 8} for p in random_prompts([3, 4, 5], vocab=1000, seed=2)]
    engine = {"dtype": "float32", "block_size": 8, "max_model_len": 256, "num_scheduler_steps": 8,
              "multi_step_budget_ms": None, "speculative_config": spec}
    (expected, expected_stats, _), (outputs, stats, calls) = (
        _counted_completions(prompts, params, **engine),
        _counted_completions(prompts, params, tensor_parallel_size=tp, pipeline_parallel_size=pp, **engine))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    got, want = stats.spec_decoding, expected_stats.spec_decoding
    assert 0 < got.num_accepted_tokens <= got.num_draft_tokens, got
    assert (got.num_draft_tokens, got.num_accepted_tokens) == (want.num_draft_tokens, want.num_accepted_tokens)
    assert calls < max(len(o.token_ids) for o in outputs) / 2, calls


def _counted_completions(prompts: list[dict], params: list[SamplingParams],
                         **engine_args) -> tuple[list, SchedulerStats, int]:
    """_completions, and how many engine steps (calls) they took."""
    llm = LLM(model_dir("llama-kv1"), in_process=True, **engine_args)
    calls, step = [], llm.client.engine.step
    llm.client.engine.step = lambda: calls.append(1) or step()
    try:
        outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return outputs, llm.get_stats(), len(calls)
    finally:
        llm.shutdown()
