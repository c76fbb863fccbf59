"""Decode ahead (workers/decode_ahead.py): the next decode step's rows, when a forward pass computed ahead may stand
in for a step's own, the scheduler's hint and lookahead slot, and, with CUDA graphs emulated on CPU (each replay
runs the model on the graphs' static inputs), outputs equal to the engine's without it while requests finish,
join, cross blocks, get preempted and sample with seeds."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import CopyStaging, assert_all_blocks_free, random_prompts, tiny_model
from core import EngineCore
from core.kv_cache_manager import KVCacheManager
from core.scheduler import Scheduler
from core.request import Request
from frontend import LLM, SamplingParams
from ipc import EngineConfig, EngineCoreRequest
from workers.cuda_graphs import DecodeGraphs
from workers.decode_ahead import AheadForward, DecodeRows, next_rows
from workers.model_runner import ModelRunner

BLOCK = 4


def rows(req_ids: list[str], seq_lens: list[int], tables: list[list[int]], width: int = 4) -> DecodeRows:
    """Decode rows whose last token sits at seq_len - 1."""
    seq_lens = np.array(seq_lens, dtype=np.int64)
    table = np.zeros((len(tables), width), dtype=np.int64)
    for row, blocks in enumerate(tables):
        table[row, :len(blocks)] = blocks
    positions = seq_lens - 1
    slots = table[np.arange(len(positions)), positions // BLOCK] * BLOCK + positions % BLOCK
    return DecodeRows(req_ids, positions, slots, seq_lens, table, np.array([len(b) for b in tables]))


def test_next_rows_move_one_position_within_the_blocks_held():
    now = rows(["a", "b"], [5, 7], [[3, 9], [4, 6]])
    after = next_rows(now, BLOCK, max_model_len=64)
    assert after.positions.tolist() == [5, 7] and after.seq_lens.tolist() == [6, 8]
    assert after.slot_mapping.tolist() == [9 * BLOCK + 1, 6 * BLOCK + 3]
    assert next_rows(rows(["a"], [8], [[3, 9]]), BLOCK, 64) is None, "position 8 needs a third block"
    assert next_rows(rows(["a"], [8], [[3, 9, 2]]), BLOCK, 64).slot_mapping.tolist() == [2 * BLOCK]
    assert next_rows(rows(["a"], [7], [[3, 9]]), BLOCK, max_model_len=7) is None


def ahead_of(now: DecodeRows, tokens: list[int]) -> AheadForward:
    ahead = AheadForward(next_rows(now, BLOCK, 64), torch.zeros(8, 2))
    ahead.token_ids = np.array(tokens)
    return ahead


def test_a_step_takes_the_rows_computed_ahead_only_from_the_same_inputs():
    now = rows(["a", "b", "c"], [5, 6, 2], [[3, 9], [4, 6], [1]])
    ahead = ahead_of(now, [11, 12, 13])
    same = next_rows(now, BLOCK, 64)
    assert ahead.rows_for(same, np.array([11, 12, 13]), BLOCK).tolist() == [0, 1, 2]
    finished_b = DecodeRows(["c", "a"], *(array[[2, 0]] for array in (
        same.positions, same.slot_mapping, same.seq_lens, same.block_tables, same.num_blocks)))
    assert ahead.rows_for(finished_b, np.array([13, 11]), BLOCK).tolist() == [2, 0]
    assert ahead.rows_for(same, np.array([11, 12, 14]), BLOCK) is None, "another token"
    grown = DecodeRows(same.req_ids, same.positions, same.slot_mapping, same.seq_lens,
                       np.pad(same.block_tables, ((0, 0), (0, 2))), same.num_blocks)
    grown.block_tables[0, 2] = 8  # a block past what row 0's attention reads
    assert ahead.rows_for(grown, np.array([11, 12, 13]), BLOCK).tolist() == [0, 1, 2]
    moved = DecodeRows(same.req_ids, same.positions, same.slot_mapping, same.seq_lens, same.block_tables.copy(),
                       same.num_blocks)
    moved.block_tables[0, 0] = 7  # a block row 0 reads
    assert ahead.rows_for(moved, np.array([11, 12, 13]), BLOCK) is None
    joined = rows(["a", "d"], [6, 3], [[3, 9], [5]])
    assert ahead.rows_for(joined, np.array([11, 0]), BLOCK) is None, "d was not computed ahead"
    ahead.token_ids = None  # its step has not returned yet
    assert ahead.rows_for(same, np.array([11, 12, 13]), BLOCK) is None


def scheduler(max_num_seqs: int = 4) -> Scheduler:
    config = EngineConfig(model="unused", max_model_len=64, max_num_seqs=max_num_seqs, block_size=BLOCK)
    return Scheduler(config, KVCacheManager(64, BLOCK), decode_ahead=True)


def add(s: Scheduler, req_id: str, prompt_len: int, max_tokens: int) -> Request:
    request = Request(EngineCoreRequest(request_id=req_id, prompt_token_ids=list(range(1, prompt_len + 1)),
                                        sampling_params=SamplingParams(max_tokens=max_tokens)), 0, max_tokens)
    s.add_request(request)
    return request


def decode(s: Scheduler, requests: list[Request]) -> None:
    """What a step's output does to the requests: one token each, which the scheduler counted computed."""
    for request in requests:
        request.append_output_token(7)


def test_the_scheduler_hints_a_decode_step_whose_requests_decode_next_and_holds_their_next_slot():
    s = scheduler()
    a = add(s, "a", 3, 10)
    assert not s.schedule().decode_ahead, "a prompt step"
    decode(s, [a])
    step = s.schedule()
    assert step.decode_ahead and s.kv.block_ids(a) and len(s.kv.block_ids(a)) == 2, "slot of position 4 held"
    decode(s, [a])
    add(s, "b", 3, 10)  # waits while a decodes: it joins the next step
    assert not s.schedule().decode_ahead
    full = scheduler(max_num_seqs=1)
    c = add(full, "c", 3, 3)
    full.schedule()
    add(full, "d", 3, 3)  # waits for c's seat
    decode(full, [c])
    assert full.schedule().decode_ahead, "c's second token of 3: d cannot join next step"
    decode(full, [c])
    assert not full.schedule().decode_ahead, "c ends with this token and d takes its seat"
    alone = scheduler()
    e = add(alone, "e", 3, 2)
    alone.schedule()
    decode(alone, [e])
    assert not alone.schedule().decode_ahead, "e ends with this token: no step follows"


class _EagerGraphs(DecodeGraphs):
    """CUDA graphs emulated on CPU: nothing captured; a replay runs the model on the static inputs."""

    def replay(self, size: int) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(self.input_ids[:size], self.positions[:size], self.metadata(size))


def emulate_graphs(engine: EngineCore, decode_ahead: bool) -> ModelRunner:
    """Send a CPU engine's decode-only steps the CUDA-graph way, with decode ahead as EngineCore sets it up when its
    executor reports CUDA graphs (or without it); its model runner."""
    runner = engine.executor.worker.model_runner
    runner.decode_graphs = _EagerGraphs(runner.model, [1, 2, 4, 8], engine.config.max_model_len,
                                        engine.config.block_size, runner.attention_layers[0].num_kv_heads,
                                        runner.device)
    runner.staging = CopyStaging()
    engine.scheduler.multi_step, engine.scheduler.num_lookahead_slots = 1, 0  # as with graphs (ModelRunner.multi_steps)
    if decode_ahead:
        engine.scheduler.decode_ahead, engine.scheduler.num_lookahead_slots = True, 1
    return runner


def emulated_graphs_llm(model_dir: str, decode_ahead: bool, **kwargs) -> LLM:
    llm = LLM(model_dir, in_process=True, device="cpu", dtype="float32", **kwargs)
    emulate_graphs(llm.client.engine, decode_ahead)
    return llm


VARIANTS = {
    # 11 requests ending one after another: decode batches shrink (the ones computed ahead are a subset).
    "finishing": ({"num_kv_blocks": 256}, 11, None),
    # 3 seats for 9 requests: a finished request's seat goes to a waiting one (a step computed ahead is dropped).
    "joining": ({"num_kv_blocks": 256, "max_num_seqs": 3}, 9, None),
    # A pool too small for all: preempted requests start over, their blocks change.
    "preempted": ({"num_kv_blocks": 14, "max_model_len": 48, "block_size": 4}, 6, None),
    "seeded": ({"num_kv_blocks": 256}, 6, SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12,
                                                          ignore_eos=True)),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_ahead_leaves_every_output_as_it_was(variant):
    kwargs, count, sampled = VARIANTS[variant]
    model_dir = tiny_model("llama")
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3 + 5 * i for i in range(count)], 1000, seed=7)]
    params = [sampled or SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True)
              for i in range(count)]
    outputs = {}
    for ahead in (False, True):
        llm = emulated_graphs_llm(model_dir, ahead, **kwargs)
        outputs[ahead] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        runner = llm.client.engine.executor.worker.model_runner
        assert (runner.ahead_hits > 0) == ahead
        if variant == "preempted":
            assert llm.get_stats().num_preemptions > 0
        assert_all_blocks_free(llm)
        llm.shutdown()
    assert [len(tokens) for tokens in outputs[True]] == [p.max_tokens for p in params]
    assert outputs[True] == outputs[False]


def test_decode_ahead_across_aborts_prefix_hits_and_logprobs():
    """Step by step: a request joins with a prefix-cache hit on a running one's blocks, that one is aborted
    mid-decode, and a third asks for logprobs; tokens and logprobs equal the engine's without decode ahead."""
    model_dir = tiny_model("llama")
    first, third = random_prompts([40, 9], 1000, seed=11)
    joins = {0: ("a", first, None), 6: ("b", first[:32] + [7, 8, 9], None), 14: ("c", third, 3)}
    results = {}
    for ahead in (False, True):
        engine = EngineCore(EngineConfig(model=model_dir, device="cpu", dtype="float32", num_kv_blocks=64))
        runner = emulate_graphs(engine, ahead)
        tokens: dict[str, list] = {}
        for step in range(200):
            if step in joins:
                req_id, prompt, logprobs = joins[step]
                engine.add_request(EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt,
                                                     sampling_params=SamplingParams(
                                                         temperature=0.0, max_tokens=30, ignore_eos=True,
                                                         logprobs=logprobs)))
            if step == 20:
                engine.abort_requests(["a"])
            for output in engine.step():
                tokens.setdefault(output.request_id, []).append((output.new_token_ids, output.new_logprobs))
            if step > 20 and not engine.has_unfinished_requests():
                break
        assert engine.kv_cache_manager.usage == 0.0 and not engine.scheduler.running
        assert engine.scheduler.stats().prefix_cache_hits >= 32, "b reused a's first two blocks"
        assert (runner.ahead_hits > 0) == ahead
        results[ahead] = tokens
        engine.shutdown()
    assert sum(len(ids) for ids, _ in results[True]["c"]) == 30
    assert results[True].keys() == results[False].keys()
    for req_id, outputs in results[True].items():
        assert [ids for ids, _ in outputs] == [ids for ids, _ in results[False][req_id]], req_id
    # A row computed ahead sat in a batch of another size (b had finished since), so float32 sums may round
    # differently: within 1e-5, as speculative decoding's logprobs must be.
    ours, theirs = ([values for _, values in results[ahead]["c"]] for ahead in (True, False))
    assert ours[-1] is not None, "c's logprobs came"
    np.testing.assert_allclose(np.array(ours, dtype=np.float64), np.array(theirs, dtype=np.float64), atol=1e-5)
