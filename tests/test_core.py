"""BlockPool, KVCacheManager and Scheduler on their own: budgets, chunking, preemption, priority, the diff."""
from __future__ import annotations

import pytest

from core.block_pool import BlockPool
from core.kv_cache_manager import KVCacheManager
from core.request import RequestStatus
from ipc import ModelRunnerOutput
from scheduler_steps import make_request, make_scheduler, run_step


def test_block_pool_reuses_oldest_freed_first():
    pool = BlockPool(4)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert pool.num_free_blocks == 0
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    pool.free(b)
    pool.free(a)
    assert pool.allocate(4) == b + a
    with pytest.raises(RuntimeError, match="not in use"):
        pool.free([0, 0, 0])


def test_kv_cache_manager_grows_block_table_on_demand():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request(0, prompt_len=5)
    assert len(kv.allocate_slots(request, 5)) == 2
    request.num_computed_tokens = 5
    assert kv.allocate_slots(request, 3) == []  # 8 tokens still fit in 2 blocks
    assert len(kv.allocate_slots(request, 4)) == 1
    assert kv.allocate_slots(request, 100) is None  # too many: nothing taken
    assert len(kv.block_ids(request)) == 3
    kv.free(request)
    assert kv.num_free_blocks == 8


def test_token_budget_chunks_prefill_and_mixes_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request(0, prompt_len=3))
    scheduler.add_request(make_request(1, prompt_len=25))
    out, _ = run_step(scheduler)
    assert out.num_scheduled_tokens == {"r0": 3, "r1": 7}
    assert [n.req_id for n in out.scheduled_new_reqs] == ["r0", "r1"]
    out, _ = run_step(scheduler)
    # r0 decodes one token while r1's prompt continues in the same batch.
    assert out.num_scheduled_tokens == {"r0": 1, "r1": 9}
    assert out.scheduled_cached_reqs[0].new_token_ids == [7]
    assert out.total_num_scheduled_tokens == 10


def test_max_num_seqs_limits_running():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(make_request(i, prompt_len=2))
    out, _ = run_step(scheduler)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert len(scheduler.waiting) == 1


def test_preemption_recomputes_latest_and_sends_full_block_table():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=16, enable_prefix_caching=False)
    scheduler.add_request(make_request(0, prompt_len=8, max_tokens=8))
    scheduler.add_request(make_request(1, prompt_len=8, max_tokens=8))
    run_step(scheduler)  # both prompts fill 2 blocks each
    out, _ = run_step(scheduler)  # r0 needs a 3rd block: r1 (latest) is preempted
    assert scheduler.num_preemptions == 1
    r1 = scheduler.requests["r1"]
    assert r1.status == RequestStatus.PREEMPTED and r1.num_computed_tokens == 0
    assert "r1" not in out.num_scheduled_tokens
    while "r0" in scheduler.requests:
        run_step(scheduler)
    out, _ = run_step(scheduler)
    [resumed] = out.scheduled_cached_reqs
    assert resumed.resumed_from_preemption and resumed.num_computed_tokens == 0
    assert out.num_scheduled_tokens["r1"] == 9  # its prompt and the token sampled before preemption
    assert resumed.new_block_ids == scheduler.kv.block_ids(r1)


def test_priority_policy_runs_lowest_value_first_and_preempts_highest():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=16, scheduling_policy="priority",
                               enable_prefix_caching=False)
    scheduler.add_request(make_request(0, prompt_len=4, priority=5, max_tokens=8))
    run_step(scheduler)  # r0 alone: 1 block
    scheduler.add_request(make_request(1, prompt_len=8, priority=1, max_tokens=8))
    run_step(scheduler)  # r0 grows to 2 blocks, r1's prompt takes the last 2
    assert [r.request_id for r in scheduler.running] == ["r1", "r0"]  # ordered by priority, not arrival
    out, _ = run_step(scheduler)  # r1 needs a third block: r0 (priority 5) is preempted, though it came first
    assert scheduler.requests["r0"].status == RequestStatus.PREEMPTED
    assert "r1" in out.num_scheduled_tokens and "r0" not in out.num_scheduled_tokens


def test_finished_and_aborted_requests_return_blocks_and_reach_workers():
    scheduler = make_scheduler(num_blocks=16)
    scheduler.add_request(make_request(0, prompt_len=5, max_tokens=2))
    scheduler.add_request(make_request(1, prompt_len=5, max_tokens=50))
    run_step(scheduler)
    _, outputs = run_step(scheduler)
    assert [o.finish_reason.value for o in outputs if o.request_id == "r0"] == ["length"]
    aborted = scheduler.abort_requests(["r1", "unknown", "r0"])
    assert [(o.request_id, o.finish_reason.value) for o in aborted] == [("r1", "abort")]
    assert scheduler.stats().num_aborted_requests == 1
    assert scheduler.kv.num_free_blocks == 16 and not scheduler.has_unfinished_requests()
    empty = scheduler.schedule()  # nothing runs, so nothing is sent: the ids wait for the next batch
    assert empty.total_num_scheduled_tokens == 0 and empty.finished_req_ids == [] and not scheduler.in_flight
    scheduler.add_request(make_request(2, prompt_len=5))
    out = scheduler.schedule()
    assert sorted(out.finished_req_ids) == ["r0", "r1"] and list(out.num_scheduled_tokens) == ["r2"]


def test_request_state_machine_rejects_illegal_transitions():
    request = make_request(0, prompt_len=1)
    with pytest.raises(RuntimeError, match="illegal transition"):
        request.set_status(RequestStatus.PREEMPTED)
    request.set_status(RequestStatus.RUNNING)
    request.set_status(RequestStatus.FINISHED_STOPPED)
    with pytest.raises(RuntimeError):
        request.set_status(RequestStatus.RUNNING)


def test_output_of_a_batch_in_flight_is_dropped_for_a_request_replaced_since():
    """Pipeline batches in flight: r1 is aborted and a new r1 scheduled before the old batch's output arrives."""
    scheduler = make_scheduler(num_blocks=8)
    scheduler.add_request(make_request(1, prompt_len=5))
    scheduler.schedule()
    scheduler.abort_requests(["r1"])
    scheduler.add_request(make_request(1, prompt_len=3))
    assert list(scheduler.schedule().num_scheduled_tokens.items()) == [("r1", 3)]
    assert scheduler.update_from_output(ModelRunnerOutput(sampled_token_ids={"r1": [11]})) == []
    [output] = scheduler.update_from_output(ModelRunnerOutput(sampled_token_ids={"r1": [22]}))
    assert output.new_token_ids == [22] and scheduler.requests["r1"].output_token_ids == [22]


def test_output_of_a_batch_in_flight_is_dropped_for_a_request_preempted_and_rescheduled_since():
    scheduler = make_scheduler(num_blocks=4, enable_prefix_caching=False, max_num_batched_tokens=8)
    scheduler.add_request(make_request(0, prompt_len=8))
    scheduler.add_request(make_request(1, prompt_len=8))
    assert list(scheduler.schedule().num_scheduled_tokens) == ["r0"]  # batch A
    assert list(scheduler.schedule().num_scheduled_tokens) == ["r1"]  # batch B, while A is in flight
    scheduler.update_from_output(ModelRunnerOutput(sampled_token_ids={"r0": [5]}))  # A
    batch_c = scheduler.schedule()  # r0 needs a third block: r1, still in flight in batch B, is preempted
    assert list(batch_c.num_scheduled_tokens) == ["r0"] and scheduler.requests["r1"].status == RequestStatus.PREEMPTED
    scheduler.abort_requests(["r0"])
    batch_d = scheduler.schedule()  # r1 starts over while batch B is still in flight
    assert batch_d.num_scheduled_tokens == {"r1": 8} and batch_d.scheduled_cached_reqs[0].resumed_from_preemption
    assert scheduler.update_from_output(ModelRunnerOutput(sampled_token_ids={"r1": [11]})) == []  # B: stale
    assert scheduler.update_from_output(ModelRunnerOutput(sampled_token_ids={"r0": [6]})) == []  # C: r0 aborted
    [output] = scheduler.update_from_output(ModelRunnerOutput(sampled_token_ids={"r1": [22]}))  # D
    assert output.new_token_ids == [22] and scheduler.requests["r1"].output_token_ids == [22]
    assert not scheduler.in_flight
