"""The engine core in its own process: same outputs as in-process, utility calls, signals, parent death."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import assert_all_blocks_free, child_pids, long_context_llama, random_prompts, wait_until
from core.engine_spawn import EngineProcess
from frontend import LLM, EngineCoreClient, EngineDeadError, SamplingParams
from ipc import EngineConfig
from ipc.sockets import private_ipc_address


def _mixed_workload() -> tuple[list, list[SamplingParams]]:
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 17, 40, 64, 9, 33], vocab=1000, seed=3)]
    prompts += ["The quick brown fox", "Once upon a time"]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20),
              SamplingParams(temperature=1.0, top_k=5, seed=5, max_tokens=16, logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=30, stop=["e"], ignore_eos=True),
              SamplingParams(temperature=0.5, min_p=0.1, seed=2, max_tokens=8, min_tokens=4),
              SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[7, 9, 11]),
              SamplingParams(temperature=0.0, max_tokens=6),
              SamplingParams(temperature=0.7, seed=1, max_tokens=6)]
    return prompts, params


def test_outputs_through_the_process_equal_in_process(llama_model):
    prompts, params = _mixed_workload()
    results, logprobs = {}, {}
    for in_process in (True, False):
        llm = LLM(llama_model, dtype="float32", in_process=in_process, max_num_batched_tokens=32)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert_all_blocks_free(llm)
        results[in_process] = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
                                o.outputs[0].stop_reason) for o in outputs]
        logprobs[in_process] = [(token, lp.logprob) for o in outputs for step in o.outputs[0].logprobs or []
                                for token, lp in sorted(step.items())]
        llm.shutdown()
    assert results[False] == results[True]
    # The engine process may run torch with another thread count than this one: last-bit float differences.
    assert [t for t, _ in logprobs[False]] == [t for t, _ in logprobs[True]] and logprobs[True]
    assert [lp for _, lp in logprobs[False]] == pytest.approx([lp for _, lp in logprobs[True]], rel=1e-4, abs=1e-5)


def test_utility_calls(llama_model, tmp_path):
    llm = LLM(llama_model, dtype="float32", profiler_dir=str(tmp_path / "traces"), profiler_max_steps=3)
    client = llm.client
    assert client.info.num_kv_blocks == llm.get_stats().num_free_blocks > 0
    assert client.info.privileged_utilities == ["reset_prefix_cache", "start_profile", "stop_profile"]
    assert client.call_utility("check_health") is True
    assert client.call_utility("reset_prefix_cache") is True
    with pytest.raises(RuntimeError, match="start_profile failed"):  # the directory is fixed at start-up
        client.call_utility("start_profile", "/tmp/elsewhere")
    assert llm.start_profile() == str(tmp_path / "traces")
    llm.generate("profile me", SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    trace = llm.stop_profile()  # it stopped itself after 3 of the 8 steps, and wrote its trace then
    assert trace.startswith(str(tmp_path / "traces")) and os.path.getsize(trace) > 0
    assert os.listdir(tmp_path / "traces") == [os.path.basename(trace)]
    with pytest.raises(RuntimeError, match="unknown utility method 'shutdown'"):
        client.call_utility("shutdown")
    with pytest.raises(RuntimeError, match="stop_profile failed.*not running"):
        client.call_utility("stop_profile")
    assert llm.generate("still serving", SamplingParams(max_tokens=3), use_tqdm=False)[0].finished
    llm.shutdown()


def test_the_vllm_profiling_example_runs_and_writes_a_trace(llama_model, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    llm = LLM(llama_model, tensor_parallel_size=1, device="cpu")
    llm.start_profile()
    outputs = llm.generate(["Hello, my name is", "The future of AI is"],
                           SamplingParams(temperature=0.8, top_p=0.95), use_tqdm=False)
    trace = llm.stop_profile()
    assert [output.prompt for output in outputs] == ["Hello, my name is", "The future of AI is"]
    assert all(output.outputs[0].token_ids and output.outputs[0].finish_reason for output in outputs)
    assert os.listdir(tmp_path / "traces") == [os.path.basename(trace)] and os.path.getsize(trace) > 0
    llm.shutdown()


def test_privileged_utilities_are_refused_unless_enabled_at_start_up(llama_model, tmp_path):
    llm = LLM(llama_model, dtype="float32", enable_cache_reset=False)
    assert llm.info.privileged_utilities == []
    for method, switch in [("start_profile", "--profiler-dir"), ("stop_profile", "--profiler-dir"),
                           ("reset_prefix_cache", "--enable-cache-reset")]:
        with pytest.raises(RuntimeError, match=f"{method} failed: PermissionError.*{switch}"):
            llm.client.call_utility(method, str(tmp_path))
    assert not os.listdir(tmp_path)
    assert llm.generate("still serving", SamplingParams(max_tokens=3), use_tqdm=False)[0].finished
    llm.shutdown()


def test_start_up_errors_keep_their_type(llama_model):
    with pytest.raises(ValueError, match="max_model_len=100000 exceeds"):
        LLM(llama_model, max_model_len=100000)


def test_engine_dead_error_within_a_second_after_kill_9(llama_model):
    llm = LLM(llama_model, dtype="float32")
    engine_pid = llm.client.process.pid
    real_get_outputs, killed_at = llm.client.get_outputs, []

    def kill_then_wait():
        if not killed_at:
            os.kill(engine_pid, signal.SIGKILL)
            killed_at.append(time.monotonic())
        return real_get_outputs()

    llm.client.get_outputs = kill_then_wait
    with pytest.raises(EngineDeadError):
        llm.generate(["a long one"] * 4, SamplingParams(max_tokens=500, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - killed_at[0] < 1.0
    with pytest.raises(EngineDeadError):
        llm.generate("later", SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()
    assert engine_pid not in child_pids()


def test_sigterm_shuts_the_engine_down_cleanly(llama_model):
    llm = LLM(llama_model, dtype="float32")
    process = llm.client.process.process
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=5) == 0
    with pytest.raises(EngineDeadError, match="signal|exited"):
        llm.generate("after", SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()


_FRONT_END = textwrap.dedent("""
    import sys, time
    from frontend import LLM, SamplingParams
    llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory=40 << 20)
    print(llm.client.process.pid, flush=True)
    llm.generate(["keep going"] * 4, SamplingParams(max_tokens=100000, ignore_eos=True), use_tqdm=False)
""")


# The front end sets no SIGTERM handler: it dies as under kill -9, and the engine sees the same pipe close.
@pytest.mark.parametrize("how", ["kill -9", pytest.param("SIGTERM", marks=pytest.mark.slow)])
def test_engine_exits_when_its_front_end_dies(how):
    # The long-context llama: its requests still run when the front end dies (they do not end and let it exit).
    front_end = subprocess.Popen([sys.executable, "-c", _FRONT_END, long_context_llama()], stdout=subprocess.PIPE,
                                 text=True)
    engine_pid = int(front_end.stdout.readline())
    time.sleep(0.5)  # let it start generating
    assert front_end.poll() is None
    front_end.send_signal(signal.SIGKILL if how == "kill -9" else signal.SIGTERM)
    front_end.wait(timeout=10)
    assert wait_until(lambda: not os.path.exists(f"/proc/{engine_pid}") or _is_zombie(engine_pid), timeout=5)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_no_process_outlives_its_llm(llama_model):
    before = set(child_pids())
    llm = LLM(llama_model, dtype="float32")
    assert set(child_pids()) - before == {llm.client.process.pid}
    llm.shutdown()
    assert set(child_pids()) == before


def test_attach_to_a_running_engine_core(llama_model):
    address = private_ipc_address()
    engine = EngineProcess(EngineConfig(model=llama_model, dtype="float32"), address)
    try:
        engine.wait_ready()
        prompts = ["one prompt", "another prompt"]
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        first = LLM(engine_address=address)
        second = LLM(llama_model, engine_address=address)
        assert [o.outputs[0].token_ids for o in first.generate(prompts, greedy, use_tqdm=False)] == \
               [o.outputs[0].token_ids for o in second.generate(prompts, greedy, use_tqdm=False)]
        with pytest.raises(ValueError, match="cannot apply to the engine core already running"):
            LLM(engine_address=address, max_num_seqs=4)
        first.shutdown()
        second.shutdown()
        assert engine.is_alive()  # clients that attached do not own the engine
    finally:
        engine.shutdown()


def test_a_client_finds_no_engine(tmp_path):
    with pytest.raises(ConnectionError, match="no engine core answered"):
        EngineCoreClient(f"ipc://{tmp_path}/nobody", handshake_timeout=0.5)
