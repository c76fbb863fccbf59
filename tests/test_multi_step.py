"""Multi-step decoding (core/multi_step.py): several decode steps per worker call give the tokens, stops and freed
blocks of one call per step."""
from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from conftest import assert_all_blocks_free, random_prompts, tiny_model, tiny_mtp_model
from core.multi_step import UNTIMED_STEPS, StepTimes, num_steps
from core.request import Request
from core.structured_output.manager import StructuredOutputManager
from frontend import LLM, SamplingParams
from ipc import EngineCoreRequest, StructuredOutputsParams
from ipc.lora import LoRARequest
from kernels.cpu_row_options import SampledRows
from launch.make_model import make_model
from workers.fast_path.later_step_calls import LaterStepCalls
from workers.spec_decode.mtp import MtpProposer

ENGINE = {"dtype": "float32", "in_process": True, "block_size": 8, "max_model_len": 96}


def _generate(steps: int, prompts: list[list[int]], params: list[SamplingParams], **engine_args
              ) -> tuple[list[list[int]], list[str], int]:
    """Each request's tokens and finish reason, all at once, and the engine steps it took (`steps` a call: no time
    budget unless given)."""
    llm = LLM(tiny_model("llama"), num_scheduler_steps=steps, **{**ENGINE, "multi_step_budget_ms": None, **engine_args})
    engine = llm.client.engine
    calls = []
    step = engine.step
    engine.step = lambda: calls.append(1) or step()
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_all_blocks_free(llm)
        return [o.outputs[0].token_ids for o in outputs], [o.outputs[0].finish_reason for o in outputs], len(calls)
    finally:
        llm.shutdown()


def _mixed_params() -> list[SamplingParams]:
    """Greedy and seeded sampled requests with what the worker applies over a call's tokens: top-p/top-k/min-p,
    penalties, logit bias, bad words, min_tokens (one step per call until it is reached); lengths that end mid-run
    (max_tokens, max_model_len), EOS allowed or ignored."""
    return [SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=7, max_tokens=30, top_p=0.9, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=8, max_tokens=64, top_k=20, min_p=0.05, presence_penalty=0.5,
                           frequency_penalty=0.3),
            SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3, logit_bias={5: 3.0}),
            SamplingParams(temperature=0.7, seed=9, max_tokens=50, bad_words_token_ids=[[3], [7, 8]], min_tokens=10),
            SamplingParams(temperature=1.2, seed=10, max_tokens=20, ignore_eos=True, repetition_penalty=1.2),
            SamplingParams(temperature=0.0, max_tokens=25)]


@pytest.mark.parametrize("engine_args", [
    {}, {"num_kv_blocks": 14, "enable_prefix_caching": True},
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                            "prompt_lookup_max": 3, "disable_by_batch_size": None}},
    {"speculative_config": {"method": "draft_model", "model": "llama", "num_speculative_tokens": 3,
                            "disable_by_batch_size": None}},
], ids=["roomy", "preempted, prefix cache", "prompt lookup", "draft model"])
def test_tokens_equal_one_call_per_step(engine_args):
    """Greedy and sampled (a seeded request draws the same numbers), with and without speculation; fewer engine
    steps than tokens."""
    if "speculative_config" in engine_args and "model" in engine_args["speculative_config"]:
        engine_args = {"speculative_config": {**engine_args["speculative_config"], "model": tiny_model("llama")}}
    prompts = random_prompts([5, 40, 17, 3, 60, 9, 12], vocab=1000, seed=2)
    prompts[5] = prompts[1][:30] + prompts[5]  # shares blocks with the second prompt
    one_by_one = _generate(1, prompts, _mixed_params(), **engine_args)
    multi = _generate(8, prompts, _mixed_params(), **engine_args)
    assert multi[:2] == one_by_one[:2]
    assert "length" in multi[1]
    if "num_kv_blocks" not in engine_args:
        assert multi[2] < one_by_one[2] / 2


@pytest.mark.parametrize("engine_args", [{}, {"speculative_config": {
    "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
    "disable_by_batch_size": None}}], ids=["plain", "prompt lookup"])
def test_logprobs_equal_one_call_per_step_and_take_several_steps(engine_args):
    """Greedy, penalized and sampled requests asking for top-N logprobs (one with EOS allowed) beside one that does
    not: the same tokens, logprobs and ranks as one call per step, in fewer calls."""
    prompts = random_prompts([5, 9, 14, 7], vocab=1000, seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=1, max_tokens=21, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True, logprobs=5, presence_penalty=0.4),
              SamplingParams(temperature=0.0, max_tokens=25, logprobs=0)]
    runs = {}
    for steps in (1, 8):
        llm = LLM(tiny_model("llama"), num_scheduler_steps=steps,
                  **{**ENGINE, "multi_step_budget_ms": None, **engine_args})
        calls, step = [], llm.client.engine.step
        llm.client.engine.step = lambda calls=calls, step=step: calls.append(1) or step()
        try:
            outputs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]
            assert_all_blocks_free(llm)
        finally:
            llm.shutdown()
        runs[steps] = outputs, len(calls)
    (multi, multi_calls), (one_by_one, calls) = runs[8], runs[1]
    assert multi_calls < calls / 2
    for got, expected, asked in zip(multi, one_by_one, params):
        assert got.token_ids == expected.token_ids
        if asked.logprobs is None:
            assert got.logprobs is None
            continue
        assert len(got.logprobs) == len(got.token_ids)
        for got_step, expected_step in zip(got.logprobs, expected.logprobs):
            assert got_step.keys() == expected_step.keys()
            for token in got_step:
                assert got_step[token].rank == expected_step[token].rank
                assert got_step[token].logprob == pytest.approx(expected_step[token].logprob, abs=1e-5)


def test_a_stop_token_inside_a_run_ends_the_request_there():
    prompt = random_prompts([11], vocab=1000, seed=4)[0]
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    [tokens], _, _ = _generate(1, [prompt], [free])
    stop = tokens[5]
    first = tokens.index(stop)
    stopped = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop])
    for steps in (1, 8):
        [out], [reason], _ = _generate(steps, [prompt], [stopped])
        assert (out, reason) == (tokens[:first + 1], "stop")


def test_constrained_requests_take_several_steps_with_the_tokens_of_one_call_per_step():
    """Regex, choice, xgrammar and llguidance JSON schemas, greedy and seeded sampled, beside a plain request: the
    worker follows a fork of each matcher through a call's steps; the same tokens and ends as one call per step."""
    prompts = random_prompts([5, 9, 14, 7, 11], vocab=1000, seed=4)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
              "required": ["name", "n"]}  # maxLength: llguidance's
    constraints = [StructuredOutputsParams(regex=r"[a-z]{3,9}( [a-z]{2,5}){2,6}\."),
                   StructuredOutputsParams(choice=["alpha beta gamma", "delta"]),
                   StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}}),
                   StructuredOutputsParams(json=schema), None]
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=40, structured_outputs=c)
              for i, c in enumerate(constraints)]
    one_by_one = _generate(1, prompts, params, max_model_len=256)
    multi = _generate(8, prompts, params, max_model_len=256)
    assert multi[:2] == one_by_one[:2]
    # fewer engine steps: calls took several steps (how many depends on when each grammar finished compiling and its
    # request joined the batch, which ends a call: 22 of 40 on one machine, under half on another)
    assert multi[2] < one_by_one[2]
    assert multi[1][:4] == ["stop"] * 4  # each constraint ended its request


def _add_compiled(manager: StructuredOutputManager, request: Request, add=StructuredOutputManager.add) -> None:
    """StructuredOutputManager.add that returns once the request's grammar compiled: bf16 sums depend on which rows
    share a step, so two runs compare only when each constrained request joins the batch at the same step."""
    add(manager, request)
    manager.pending[request.request_id].future.result()


def _near_draft() -> str:
    """The tiny llama's weights with another norm epsilon: a draft right about half the time."""
    return str(make_model(Path(tiny_model("llama")).parent / "llama-tiny-near-draft", arch="llama", size="tiny",
                          rms_norm_eps=0.003))


CPP_CASES = [("llama", "plain"), ("llama", "prompt lookup"), ("llama", "draft model"), ("llama", "sampled"),
             ("llama", "penalized"), ("llama", "logprobs"), ("llama", "logprobs, prompt lookup"),
             ("llama", "constrained"), ("llama", "sampled, prompt lookup"), ("llama", "penalized, prompt lookup"),
             ("llama", "constrained, prompt lookup"), ("llama", "sampled, draft model"),
             ("llama", "penalized, draft model"), ("gemma2", "plain"), ("gemma2", "sampled"), ("gemma2", "logprobs"),
             ("gpt_neox", "plain"), ("qwen2_moe", "plain"), ("opt", "plain"), ("deepseek_v3", "mtp"),
             ("deepseek_v3", "sampled, mtp"), ("deepseek_v3", "penalized, mtp")]
# In bfloat16 by default: each family's layers, a draft model's and one sampled mode; the other modes read the
# logits widened to float32 as in float32 (score_row), so their bfloat16 runs are slow.
BF16_DEFAULT = {("llama", "draft model"), ("llama", "sampled"), ("deepseek_v3", "mtp")} | {
    (arch, "plain") for arch, _ in CPP_CASES}


@pytest.mark.parametrize(("arch", "mode", "dtype"), [
    (arch, mode, dtype) if dtype == "float32" or (arch, mode) in BF16_DEFAULT
    else pytest.param(arch, mode, dtype, marks=pytest.mark.slow)
    for dtype in ("float32", "bfloat16") for arch, mode in CPP_CASES])
def test_later_steps_in_one_cpp_call_equal_python_steps(monkeypatch, dtype, arch, mode):
    """The model's greedy_decode (a call's later steps in one C++ call) gives the tokens, finish reasons and KV cache
    bytes of the Python loop, with rows ending at different steps: a stop token mid-run, max_tokens, max_model_len
    and the slots left in a tight cache. With prompt lookup or a draft model it drafts and keeps what the Python
    steps do (the K/V of rejected drafts included, so the same drafts and counts). Sampled: seeded
    requests with temperature, top-k, top-p and min-p among greedy ones draw the sampler's tokens; penalized:
    greedy and sampled requests with presence, frequency and repetition penalties, logit bias and bad words (one
    token, and two); logprobs: greedy,
    sampled and penalized requests reporting top-N logprobs (the same ids, ranks and values) beside one that does
    not; constrained: greedy, sampled, penalized and logprob-reporting requests under regex, choice and JSON
    constraints (one that ends its grammar under ignore_eos) beside free ones, each step's mask filled by the forks
    of their matchers. ", prompt lookup": the same requests verifying drafts (sampled ones by the speculative rule at
    the uniform draws the sampler's steps would read, penalized ones counting the drafts before each, constrained
    ones with none); ", draft model": a draft model's drafts processed and drawn as the target's, verified against
    the distributions they were drawn from; ", mtp": the tiny DeepSeek-V3's MTP layer's, from the target's hidden
    states after each step. Gemma 2: its embedding scale and soft-capped logits in C++ too."""
    drafter = next((d for d in ("prompt lookup", "draft model", "mtp") if mode.endswith(d)), None)
    feature, lookup = mode.removesuffix(drafter or "").removesuffix(", ") or "plain", drafter is not None
    prompts = [p + p[:12] for p in random_prompts([5, 40, 17, 70, 9], vocab=1000, seed=6)]  # something to look up
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (37, 11, 64, 50, 20)]
    if feature == "sampled":
        free[1:] = [SamplingParams(temperature=0.9, seed=4, max_tokens=11, ignore_eos=True, top_p=0.8),
                    SamplingParams(temperature=1.3, seed=5, max_tokens=64, ignore_eos=True, top_k=30, min_p=0.02),
                    free[3], SamplingParams(temperature=0.7, seed=6, max_tokens=20, ignore_eos=True)]
    if feature == "penalized":
        free[1:] = [SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True, repetition_penalty=1.3,
                                   logit_bias={5: 3.0, 900: -2.0}),
                    SamplingParams(temperature=1.0, seed=5, max_tokens=64, ignore_eos=True, top_k=30,
                                   presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=0.9),
                    free[3], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, presence_penalty=-0.5,
                                            frequency_penalty=1.7)]
    if feature == "constrained":
        free[1:] = [SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True, logprobs=2,
                                   structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2,5}( [a-z]{2,5})+")),
                    SamplingParams(temperature=1.0, seed=5, max_tokens=64, ignore_eos=True, presence_penalty=0.5,
                                   structured_outputs=StructuredOutputsParams(json={
                                       "type": "object", "properties": {"a": {"type": "integer"}}})),
                    free[3], SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.2,
                                            structured_outputs=StructuredOutputsParams(choice=["one two", "three"]))]
    engine_args = {"dtype": dtype, "num_kv_blocks": 40 + 8 * lookup, "enable_prefix_caching": False,
                   "max_model_len": 120}
    if feature == "logprobs":
        free[1:] = [SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True, logprobs=3),
                    SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=0), free[3],
                    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=5)]
        free[2] = SamplingParams(temperature=1.0, seed=5, max_tokens=64, ignore_eos=True, top_k=30, logprobs=2)
        free[4] = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, presence_penalty=0.5,
                                 logprobs=4)
    if drafter == "prompt lookup":
        engine_args["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                             "prompt_lookup_max": 3, "disable_by_batch_size": None}
    elif drafter == "draft model":
        engine_args["speculative_config"] = {"method": "draft_model", "model": _near_draft(),
                                             "num_speculative_tokens": 3, "disable_by_batch_size": None}
    elif drafter == "mtp":  # drafting once two requests are left (penalized: always), the layer fed every step
        engine_args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": 3,
                                             "disable_by_batch_size": None if feature == "penalized" else 2}
    if feature == "constrained":  # each request joins at the step it came in (not when its grammar compiled)
        monkeypatch.setattr(StructuredOutputManager, "add", _add_compiled)
    calls, verifying = [], set()  # verifying: the kinds of request whose drafts a C++ call verified
    observed = []  # C++ calls past the cut-off that fed the MTP layer all the same
    observer = MtpProposer.kernel_observer
    monkeypatch.setattr(MtpProposer, "kernel_observer",
                        lambda self, *args: observed.append(observer(self, *args)) or observed[-1])
    in_one_call = LaterStepCalls._in_one_call

    def counted(self, steps, count, output, grammars):
        before = {req_id: len(checks) for req_id, checks in output.verified.items()}
        ran = in_one_call(self, steps, count, output, grammars)
        calls.append(ran and (feature != "constrained" or bool(grammars)))
        for state in steps.states if ran else ():
            if len(output.verified.get(state.req_id, ())) > before.get(state.req_id, 0):
                params = state.sampling_params
                verifying.update(kind for kind, has in (("any", True), ("sampled", not params.is_greedy),
                                                        ("penalized", not params.logits_as_they_are)) if has)
        return ran

    def run(cpp: bool) -> tuple[list[list[int]], list[str], list[torch.Tensor], object, list]:
        monkeypatch.setattr(LaterStepCalls, "_in_one_call",
                            counted if cpp else lambda self, steps, count, output, grammars: False)
        # No time budget: both runs make the same calls, so their caches hold the same blocks.
        llm = LLM(tiny_mtp_model() if drafter == "mtp" else tiny_model(arch), num_scheduler_steps=8,
                  multi_step_budget_ms=None, **{**ENGINE, **engine_args})
        try:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            assert_all_blocks_free(llm)
            caches = [c.clone() for c in llm.client.engine.executor.worker.model_runner.kv_caches]
            return ([o.outputs[0].token_ids for o in outputs], [o.outputs[0].finish_reason for o in outputs], caches,
                    llm.get_stats().spec_decoding, [o.outputs[0].logprobs for o in outputs])
        finally:
            llm.shutdown()

    params = free
    [first, *others], *_ = run(cpp=False)
    params = [SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True, stop_token_ids=[first[9]]), *free[1:]]
    if feature == "penalized":  # bad words that bite: a token the last request took, and a pair it took later
        words = [[others[3][2]], others[3][6:8]]
        params[4] = msgspec.structs.replace(params[4], bad_words_token_ids=words)
    python, cpp = run(cpp=False), run(cpp=True)
    assert cpp[:2] == python[:2]
    if feature == "penalized":
        assert words[0][0] not in cpp[0][4] and cpp[0][4] != others[3]
    assert {"stop", "length"} <= set(cpp[1])
    if feature != "constrained":  # constrained requests join when their grammar compiles: the blocks they get vary
        assert all(torch.equal(a, b) for a, b in zip(cpp[2], python[2], strict=True))
    for got, expected, asked in zip(cpp[4], python[4], params, strict=True):
        assert (got is None) == (asked.logprobs is None)
        for got_step, expected_step in zip(got or [], expected or [], strict=True):
            assert got_step.keys() == expected_step.keys() and len(got_step) >= asked.logprobs
            for token, logprob in got_step.items():
                assert logprob.rank == expected_step[token].rank
                assert logprob.logprob == pytest.approx(expected_step[token].logprob, abs=1e-5)
    assert cpp[3] == python[3]
    if lookup:  # penalties and grammars make fewer repeats to look up
        assert cpp[3].num_drafts > (10 if feature in ("plain", "logprobs") or drafter != "prompt lookup" else 3)
        # The random MTP layer's argmax never matches the target's: its drafts are kept only where rows sample.
        assert (drafter == "mtp" and feature == "plain" or 0 < cpp[3].num_accepted_tokens) \
            and cpp[3].num_accepted_tokens < cpp[3].num_draft_tokens
        assert {"any", feature} & {"any", "sampled", "penalized"} <= verifying
    assert any(calls)  # the C++ calls ran (not only the fallback)
    assert any(layer is not None for layer in observed) == (drafter == "mtp" and feature != "penalized")


def _request(params: SamplingParams, prompt_len: int = 10, outputs: int = 0) -> Request:
    request = Request(EngineCoreRequest(request_id="r", prompt_token_ids=list(range(prompt_len)),
                                        sampling_params=params), arrival_index=0,
                      max_tokens=params.max_tokens or 10**9)
    for token in range(outputs):
        request.append_output_token(token)
    return request


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, min_tokens=4),
    SamplingParams(temperature=0.7, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
], ids=["min_tokens ahead", "grammar"])
def test_requests_that_need_the_scheduler_between_steps_take_one(params):
    assert num_steps([_request(SamplingParams(temperature=0.0, max_tokens=100)), _request(params)], 8, 1000) == 1


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7), SamplingParams(temperature=0.9, top_k=5, top_p=0.8, min_p=0.1, seed=3),
    SamplingParams(temperature=0.0, presence_penalty=0.5), SamplingParams(temperature=0.0, logit_bias={5: 1.0}),
    SamplingParams(temperature=0.0, bad_words_token_ids=[[3]]), SamplingParams(temperature=0.0, min_tokens=2),
    SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.7, logprobs=0),
], ids=["sampled", "top-k, top-p, min-p, seed", "penalty", "logit bias", "bad words", "min_tokens reached",
        "logprobs", "sampled logprobs"])
def test_requests_the_worker_samples_alone_take_several_steps(params):
    assert num_steps([_request(SamplingParams(temperature=0.0, max_tokens=100)), _request(params, outputs=2)],
                     8, 1000) == 8


def test_adapter_requests_take_several_steps():
    """An adapter's deltas are applied at every step of a call (test_lora.py compares such calls with PEFT)."""
    adapted = Request(EngineCoreRequest(request_id="a", prompt_token_ids=list(range(10)),
                                        sampling_params=SamplingParams(temperature=0.0, max_tokens=100),
                                        lora_request=LoRARequest("adapter", 1, "/adapters/a")),
                      arrival_index=0, max_tokens=100)
    assert num_steps([_request(SamplingParams(temperature=0.0, max_tokens=100)), adapted], 8, 1000) == 8


def test_steps_stop_at_the_nearest_length_limit():
    greedy = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=2)
    assert num_steps([_request(greedy, outputs=2)], 8, 1000) == 8
    assert num_steps([_request(greedy, outputs=15), _request(greedy, outputs=2)], 8, 1000) == 5  # max_tokens
    assert num_steps([_request(greedy, prompt_len=995, outputs=2)], 8, 1000) == 3  # max_model_len
    assert num_steps([_request(greedy, outputs=2)], 1, 1000) == 1


def test_a_call_takes_the_steps_its_time_budget_holds_by_batch_size():
    times = StepTimes(budget_s=0.05)
    assert times.limit(1, 64) == UNTIMED_STEPS  # no timing yet: a short call to time
    times.observe(batch=1, steps=2, seconds=0.2)  # 0.1 s a step: past the budget alone
    assert times.limit(1, 64) == 1
    times.observe(batch=4, steps=8, seconds=0.008)  # 1 ms a step for 4-7 requests
    assert times.limit(4, 64) == times.limit(7, 64) == 50 and times.limit(6, 16) == 16
    assert times.limit(8, 64) == UNTIMED_STEPS and times.limit(3, 64) == UNTIMED_STEPS
    times.observe(batch=5, steps=4, seconds=0.012)  # 3 ms a step: the estimate moves half way
    assert times.limit(4, 64) == 25
    assert StepTimes(budget_s=None).limit(1, 64) == 64


@pytest.mark.parametrize("budget_ms, most_calls", [(None, 4), (1e-6, None)])
def test_the_engine_times_its_calls_against_the_budget(budget_ms, most_calls):
    """Without a budget, num_scheduler_steps a call; with one no step fits, a step a call once timed. Same tokens."""
    prompt = random_prompts([7], vocab=1000, seed=5)[0]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    [reference], _, _ = _generate(1, [prompt], [params])
    [tokens], _, calls = _generate(64, [prompt], [params], multi_step_budget_ms=budget_ms)
    assert tokens == reference
    if most_calls is not None:
        assert calls <= most_calls
    else:
        assert calls >= 60 - UNTIMED_STEPS


def test_a_sampled_row_without_a_token_to_draw_fails_alone_in_the_cpp_steps():
    """A NaN among one row's logits (here every row's: the head's last row) ends a sampled row at its first step,
    reported as failed; a greedy row beside it takes its steps (torch's argmax, which the kernel follows, takes the
    NaN)."""
    llm = LLM(tiny_model("llama"), **ENGINE)
    try:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)  # prepares
        model = llm.client.engine.executor.worker.model_runner.model
        model.lm_head.weight[-1] = float("nan")  # tied to the embedding: token vocab - 1 is never fed here
        sampled = SampledRows(np.array([1.0, 0.0], dtype=np.float32), np.zeros(2, dtype=np.int64),
                              np.ones(2, dtype=np.float32), np.zeros(2, dtype=np.float32), np.full((2, 4), 0.5))
        run = model.greedy_decode(np.array([7, 8]), np.array([3, 3]), np.array([[1, 2], [3, 4]]), np.array([4, 4]),
                                  [set(), set()], 4, None, sampled)
        assert run is not None and run.failed.tolist() == [True, False]
        assert (run.tokens[0] < 0).all() and run.tokens.shape[1] >= 1
    finally:
        llm.shutdown()
