"""Speculative decoding: drafts change how fast tokens come, never which tokens (greedy) or from what distribution."""
from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import numpy as np
import openai
import pytest
import torch

from conftest import API_KEY, metric, random_prompts, tiny_model
from launcher import start_launcher, stop_launcher
from core import EngineCore
from frontend import LLM
from frontend.api.metrics import _spec_decoding_metrics
from ipc import EngineConfig, EngineCoreOutputs, EngineCoreRequest, SamplingParams, SpecDecodingStats
from workers.layers.sampler import Sampler
from workers.request_state import CachedRequestState
from workers.executor import InProcessExecutor
from workers.spec_decode import Speculator
from workers.spec_decode.ngram import ngram_draft
from workers.step_sampling import SampleGroup, StepSampler

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "disable_by_batch_size": None}
ENGINE = {"dtype": "float32", "block_size": 8, "max_model_len": 160}


def _prompts(vocab: int) -> list[list[int]]:
    """Prompts that repeat themselves: the random test model's greedy output then runs into loops that prompt
    lookup partly predicts."""
    short, long = random_prompts([3, 5], vocab, seed=3), random_prompts([19, 50], vocab, seed=4)
    return [short[0] * 8, long[0] + long[0][:10], short[1] * 6, long[1] + long[1][:10]]


def _run(model: str, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], spec=None,
         **engine_args) -> tuple[dict[str, list], EngineCore]:
    """Each request's tokens (and logprobs, prompt logprobs when asked); every block back in the pool."""
    engine = EngineCore(EngineConfig(model=model, speculative_config=spec, **{**ENGINE, **engine_args}))
    params = params if isinstance(params, list) else [params] * len(prompts)
    results: dict[str, dict] = {}
    try:
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            engine.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=sp))
            results[f"r{i}"] = {"tokens": [], "logprobs": [], "prompt_logprobs": None, "finish": None}
        while engine.has_unfinished_requests():
            for output in EngineCoreOutputs.of_step(engine.step()).outputs:
                result = results[output.request_id]
                result["tokens"] += output.new_token_ids
                result["logprobs"] += output.new_logprobs or []
                result["prompt_logprobs"] = output.prompt_logprobs or result["prompt_logprobs"]
                result["finish"] = output.finish_reason or result["finish"]
        assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks
        return results, engine
    finally:
        engine.shutdown()


def _tokens(results: dict[str, dict]) -> dict[str, list[int]]:
    return {req_id: result["tokens"] for req_id, result in results.items()}


def _spec_stats(engine: EngineCore) -> SpecDecodingStats:
    return engine.get_stats().spec_decoding


@pytest.fixture
def oracle(monkeypatch):
    """Make each draft the given continuation's next tokens, the first `right` of them as they are (None: all) and
    the rest off by one (rejected)."""
    def install(futures: dict[str, list[int]], vocab: int, right: int | None = None) -> None:
        def propose(self, requests, sampled, only=None):
            drafts = {}
            for req_id, new_tokens in sampled.items():
                if req_id not in futures or (only is not None and req_id not in only):  # (the memory profile's
                    continue  # requests on a GPU)
                state = requests[req_id]
                done = state.num_output_tokens + len(new_tokens)
                future = futures[req_id][done:done + self.config.num_speculative_tokens]
                if future:
                    drafts[req_id] = [t if right is None or i < right else (t + 1) % vocab
                                      for i, t in enumerate(future)]
            return drafts
        monkeypatch.setattr(Speculator, "propose", propose)
        # the C++ greedy steps would draft their own
        monkeypatch.setattr(Speculator, "kernel_drafts", lambda self, states, contexts, capacity, drafting=True: None)
    return install


def test_ngram_draft_follows_the_latest_longest_suffix_match():
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 2, 3]
    assert ngram_draft(tokens, 3, 2, 4) == [7, 8, 2]  # [2, 3] occurs twice: the later one
    assert ngram_draft([5, 1, 2, 3, 4, 0, 2, 3, 6, 1, 2, 3], 2, 1, 3) == [4, 0]  # [1, 2, 3] beats [2, 3]
    assert ngram_draft([5, 1, 2, 3, 4, 0, 2, 3, 6, 1, 2, 3], 2, 1, 2) == [6, 1]  # capped at max_n = 2
    assert ngram_draft([4, 2, 3, 9, 2, 3], 5, 3, 4) == []  # shorter than min_n
    assert ngram_draft([1, 2, 3, 1], 8, 1, 4) == [2, 3, 1]  # as many as followed
    assert ngram_draft([7], 2, 1, 3) == [] and ngram_draft([3, 3], 2, 1, 3) == [3]
    # the bytes of [256, 0, 0] hold those of [1, 0] one byte in: not an occurrence
    assert ngram_draft([256, 0, 0, 9, 1, 0], 2, 2, 2) == []


def test_ngram_draft_equals_a_direct_search():
    """Random short token streams over a small vocabulary (many partial matches) against the definition."""
    def direct(tokens, num_tokens, min_n, max_n):
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            for end in range(len(tokens) - 2, n - 2, -1):  # latest occurrence ending before the last token
                if tokens[end - n + 1:end + 1] == tokens[-n:]:
                    return tokens[end + 1:end + 1 + num_tokens]
        return []

    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.choice([0, 1, 2, 256, 65536, 70000]) for _ in range(rng.randint(1, 40))]
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        assert ngram_draft(tokens, 4, min_n, max_n) == direct(tokens, 4, min_n, max_n), tokens


def test_greedy_output_and_logprobs_equal_no_speculation(arch_model, oracle):
    """Per architecture (mistral: a sliding window), drafts of which two of three are accepted: the tokens, and
    prompt logprobs and per-token logprobs within 1e-5."""
    arch, model = arch_model
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    prompts = _prompts(1000)
    expected, _ = _run(model, prompts, params)
    oracle(_tokens(expected), 1000, right=2)
    results, engine = _run(model, prompts, params, NGRAM)
    assert _tokens(results) == _tokens(expected)
    stats = _spec_stats(engine)
    assert stats.accepted_per_position[:2] == stats.drafted_per_position[:2] and stats.accepted_per_position[2] == 0
    for req_id, result in results.items():
        np.testing.assert_allclose(result["logprobs"], expected[req_id]["logprobs"], atol=1e-5)
        np.testing.assert_allclose(result["prompt_logprobs"].logprobs, expected[req_id]["prompt_logprobs"].logprobs,
                                   atol=1e-5)


SCENARIOS = {
    "chunked prefill and a token budget that cuts drafts": ({"max_num_batched_tokens": 10}, {}),
    "preemption": ({"num_kv_blocks": 22}, {}),
    "prefix-cache hits": ({}, {"shared_prefix": True}),
    "stop token inside an accepted run": ({}, {"stop_at": 7}),
    "max_tokens reached inside a run": ({}, {"max_tokens": 14}),
}


@functools.cache
def _without_speculation(model: str, scenario: str) -> tuple[list[list[int]], list[SamplingParams] | SamplingParams,
                                                               dict[str, list[int]], dict[str, list[int]]]:
    """A scenario's prompts, params and tokens without speculation (with and without its stop), computed once for
    the three kinds of drafts."""
    engine_args, case = SCENARIOS[scenario]
    prompts = _prompts(1000)
    if case.get("shared_prefix"):
        prompts = [prompts[3][:40] + p for p in prompts] + [prompts[3][:40] + prompts[0]]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    expected = unbounded = _tokens(_run(model, prompts, params, **engine_args)[0])
    if "stop_at" in case or "max_tokens" in case:
        params = [SamplingParams(max_tokens=case.get("max_tokens", 30), temperature=0.0,
                                 stop_token_ids=[tokens[case["stop_at"]]] if "stop_at" in case else None)
                  for tokens in unbounded.values()]
        expected = _tokens(_run(model, prompts, params, **engine_args)[0])
        assert all(len(expected[r]) < len(unbounded[r]) for r in expected)
    return prompts, params, expected, unbounded


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("drafts", ["ngram", "always right", "always wrong"])
def test_greedy_output_equals_no_speculation(llama_model, oracle, scenario, drafts):
    """The oracle's drafts run on past max_tokens and past the stop token: what follows them is dropped."""
    engine_args, _ = SCENARIOS[scenario]
    prompts, params, expected, unbounded = _without_speculation(llama_model, scenario)
    if drafts != "ngram":
        oracle(unbounded, 1000, right=0 if drafts == "always wrong" else None)
    results, engine = _run(llama_model, prompts, params, NGRAM, **engine_args)
    assert _tokens(results) == expected
    stats = _spec_stats(engine)
    if drafts == "ngram":
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    elif drafts == "always right":
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    elif drafts == "always wrong":
        assert stats.num_accepted_tokens == 0 and stats.num_draft_tokens > 0
    if scenario == "preemption":
        assert engine.get_stats().num_preemptions > 0
    if scenario == "prefix-cache hits":
        assert engine.get_stats().prefix_cache_hits > 0


@pytest.mark.parametrize("drafts", ["ngram", "always right", "always wrong"])
def test_multi_step_calls_verify_the_same_drafts_in_fewer_engine_steps(llama_model, oracle, drafts):
    """A multi-step call verifies, after its first step, the drafts proposed after each step before: the same tokens
    and the same verifications as one call per step, in fewer engine steps."""
    prompts = _prompts(1000)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    expected = _tokens(_run(llama_model, prompts, params)[0])
    if drafts != "ngram":
        oracle(expected, 1000, right=0 if drafts == "always wrong" else None)
    runs = {}
    for steps in (1, 8):
        engine_steps = []
        step = EngineCore.step
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(EngineCore, "step", lambda self: engine_steps.append(1) or step(self))
            results, engine = _run(llama_model, prompts, params, NGRAM, num_scheduler_steps=steps,
                                   multi_step_budget_ms=None)
        runs[steps] = _tokens(results), _spec_stats(engine), len(engine_steps)
    assert runs[1][0] == runs[8][0] == expected
    assert runs[1][1] == runs[8][1] and runs[8][1].num_drafts > 0
    assert runs[8][2] < runs[1][2] / 2


def _draft_config(arch: str) -> dict:
    return {"method": "draft_model", "model": tiny_model(arch), "num_speculative_tokens": 3,
            "disable_by_batch_size": None}


@pytest.mark.parametrize("draft", ["llama", "qwen2"], ids=["the target as its own draft", "an unrelated draft"])
@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 16, "num_kv_blocks": 20}],
                         ids=["roomy", "chunked and preempted"])
def test_draft_model_greedy_output_equals_no_speculation(llama_model, draft, engine_args):
    """Its KV follows the target's blocks through chunks, preemption and rejected drafts: the target as its own draft
    has every draft accepted, an unrelated random model none."""
    prompts = _prompts(1000)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = _tokens(_run(llama_model, prompts, params, **engine_args)[0])
    results, engine = _run(llama_model, prompts, params, _draft_config(draft), **engine_args)
    assert _tokens(results) == expected
    stats = _spec_stats(engine)
    assert stats.num_draft_tokens > 0
    assert stats.acceptance_rate == (1.0 if draft == "llama" else 0.0)
    if "num_kv_blocks" in engine_args:
        assert engine.get_stats().num_preemptions > 0


def test_draft_model_drafts_from_the_target_s_own_distribution(llama_model):
    """The target as its own draft: q equals p after temperature, top_p, min_p and penalties (each draft row counting
    the drafts before it), so every sampled draft is accepted; seeded requests repeat."""
    prompts = _prompts(1000)
    params = [SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, min_p=0.02, seed=i, presence_penalty=0.7,
                             frequency_penalty=0.2, logit_bias={5: 2.0}, min_tokens=6) for i in range(len(prompts))]
    first, engine = _run(llama_model, prompts, params, _draft_config("llama"))
    second, _ = _run(llama_model, prompts, params, _draft_config("llama"))
    assert _tokens(first) == _tokens(second)
    stats = _spec_stats(engine)
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate == 1.0


def test_max_model_len_bounds_the_drafts(llama_model, oracle):
    """Drafts never reach past max_model_len: the request ends there, as without speculation."""
    prompts = _prompts(1000)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    expected = _run(llama_model, prompts, params, max_model_len=72)[0]
    oracle(_tokens(expected), 1000)
    results, _ = _run(llama_model, prompts, params, NGRAM, max_model_len=72)
    assert _tokens(results) == _tokens(expected)
    assert all(len(prompt) + len(result["tokens"]) == 72 for prompt, result in zip(prompts, results.values()))


def test_seeded_sampled_requests_repeat_and_speculation_stays_on(llama_model):
    prompts = _prompts(1000)
    params = [SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=i, presence_penalty=0.5,
                             logit_bias={5: 2.0}, min_p=0.01, min_tokens=4) for i in range(len(prompts))]
    first, engine = _run(llama_model, prompts, params, NGRAM)
    second, _ = _run(llama_model, prompts, params, NGRAM)
    assert _tokens(first) == _tokens(second)
    assert _spec_stats(engine).num_draft_tokens > 0


def test_batches_past_the_cut_off_do_not_speculate(llama_model):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    _, engine = _run(llama_model, _prompts(1000), params, {**NGRAM, "disable_by_batch_size": 3})
    assert _spec_stats(engine).num_drafts == 0
    _, engine = _run(llama_model, _prompts(1000)[:3], params, {**NGRAM, "disable_by_batch_size": 3})
    assert _spec_stats(engine).num_drafts > 0


def test_streamed_http_output_with_speculation_equals_offline_without(llama_model):
    """Several tokens per step reach an SSE stream intact; the gateway's /metrics counts the drafts."""
    prompts = [{"prompt_token_ids": prompt} for prompt in _prompts(1000)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    offline = LLM(llama_model, dtype="float32", max_model_len=160, in_process=True)
    try:
        expected = [output.outputs[0].text for output in offline.generate(prompts, params, use_tqdm=False)]
    finally:
        offline.shutdown()
    process, base_url = start_launcher(["--model", llama_model, "--dtype", "float32", "--max-model-len", "160",
                                        "--api-key", API_KEY, "--speculative-config", json.dumps(NGRAM)])
    try:
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)
        for prompt, text in zip(prompts, expected):
            stream = client.completions.create(model=llama_model, prompt=prompt["prompt_token_ids"], max_tokens=30,
                                               temperature=0.0, stream=True, extra_body={"ignore_eos": True})
            assert "".join(chunk.choices[0].text for chunk in stream) == text
        accepted = metric(base_url, "pagedserve:spec_decode_num_accepted_tokens_total")
        assert 0 < accepted < metric(base_url, "pagedserve:spec_decode_num_draft_tokens_total")
    finally:
        assert stop_launcher(process) == 0


# -- the acceptance rule, on the sampler alone -----------------------------------------------------------------------
VOCAB = 12
SAMPLED_SETTINGS = {
    "temperature 0.7, top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "min_p": SamplingParams(temperature=1.0, min_p=0.1),
    "presence penalty": SamplingParams(temperature=1.0, presence_penalty=2.0),
    "logit_bias": SamplingParams(temperature=1.0, logit_bias={3: 1.5, 7: -2.0}),
}


def _states(count: int, params: SamplingParams, context: list[int]) -> list[CachedRequestState]:
    return [CachedRequestState(f"q{i}", list(context), 2, params, None, [], len(context)) for i in range(count)]


def _two_sample_p_value(a: np.ndarray, b: np.ndarray) -> float:
    """Chi-square test that two samples of token ids come from one distribution."""
    counts_a, counts_b = np.bincount(a, minlength=VOCAB), np.bincount(b, minlength=VOCAB)
    used = (counts_a + counts_b) > 0
    ka, kb = np.sqrt(len(b) / len(a)), np.sqrt(len(a) / len(b))
    statistic = (((ka * counts_a - kb * counts_b) ** 2)[used] / (counts_a + counts_b)[used]).sum()
    dof = used.sum() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


_DRAFTS = [(0, False, "likely draft"), (3, False, "unlikely draft"),
           (None, True, "drafts drawn from a draft model's q")]


# Drafts from a draft model's q take every setting by default; a likely and an unlikely draft token take the first
# one (the other pairings are slow: each case draws thousands of samples).
@pytest.mark.parametrize("setting, rank, draft_model", [
    pytest.param(setting, rank, draft_model, id=f"{name}-{setting}",
                 marks=() if draft_model or setting == next(iter(SAMPLED_SETTINGS)) else pytest.mark.slow)
    for rank, draft_model, name in _DRAFTS for setting in SAMPLED_SETTINGS])
def test_verified_tokens_follow_the_distribution_sampling_would_use(setting, rank, draft_model):
    """20k requests each verify one draft: the first token's distribution is the target's, and after an accepted
    draft the next one is the target's given that draft (penalties count it)."""
    params, count = SAMPLED_SETTINGS[setting], 20_000
    generator = torch.Generator().manual_seed(0)
    first_logits, second_logits = torch.randn(2, VOCAB, generator=generator) * 1.5
    draft = int(first_logits.argsort(descending=True)[rank or 0])
    context = [4, draft, 9]
    sampler = StepSampler(Sampler(torch.Generator().manual_seed(1)), torch.device("cpu"))

    def sample(states, logits, drafts):
        groups = [SampleGroup(state, drafts) for state in states]
        output = sampler.sample(logits.repeat(len(states), 1), groups, None)
        return [output.sampled_token_ids[state.req_id] for state in states]

    verified = sample(_states(count, params, context), torch.stack([first_logits, second_logits]), [draft])
    if draft_model:  # each draft drawn from its own q, which the verification is given
        q = torch.softmax(torch.randn(VOCAB, generator=generator), dim=-1)
        drafts = torch.multinomial(q, count, replacement=True, generator=generator).tolist()
        groups = [SampleGroup(state, [d], q.unsqueeze(0)) for state, d in zip(_states(count, params, context), drafts)]
        output = sampler.sample(torch.stack([first_logits, second_logits]).repeat(count, 1), groups, None)
        verified = [output.sampled_token_ids[g.state.req_id] for g in groups]
        draft_of = np.array(drafts)
    plain_first = sample(_states(count, params, context), first_logits.unsqueeze(0), [])
    plain_second = sample(_states(count, params, context + [draft]), second_logits.unsqueeze(0), [])
    firsts = np.array([tokens[0] for tokens in verified])
    seconds = np.array([tokens[1] for tokens in verified if len(tokens) == 2])
    assert _two_sample_p_value(firsts, np.array(plain_first).ravel()) > 1e-3
    if draft_model:  # the second token's context varies with the draft: only the first is checked
        assert 0 < len(seconds) == (firsts == draft_of).sum() < count
        return
    assert len(seconds) == (firsts == draft).sum() > (1000 if rank == 0 else 0)
    if len(seconds) > 200:
        assert _two_sample_p_value(seconds, np.array(plain_second).ravel()) > 1e-3
    # The test tells distributions apart: the second position without the draft in its context is another one.
    if setting == "presence penalty":
        plain_without_draft = sample(_states(count, params, context), second_logits.unsqueeze(0), [])
        assert _two_sample_p_value(seconds, np.array(plain_without_draft).ravel()) < 1e-4


def test_a_draft_model_with_another_vocabulary_is_refused(llama_model):
    draft = Path(__file__).resolve().parents[1] / "launch" / "weights" / "draft"
    with pytest.raises(ValueError, match=r"vocabulary of 4096 tokens, the target \d+"):
        EngineCore(EngineConfig(model=llama_model, speculative_config={
            "method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}))


# -- configuration and metrics ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("config, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "exceeds prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "unknown field `lookahead`"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "required by method 'draft_model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "only by it"),
    ('{"method": "ngram", ', "not valid JSON"),
])
def test_a_bad_speculative_config_is_refused_with_its_reason(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="unused", speculative_config=config)


def test_metrics_give_every_acceptance_figure():
    stats = SpecDecodingStats()
    stats.observe(3, 3)
    stats.observe(3, 1)
    stats.observe(2, 0)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 4)
    assert stats.drafted_per_position == [3, 3, 2] and stats.accepted_per_position == [2, 1, 1]
    assert stats.acceptance_rate == 0.5 and stats.mean_acceptance_length == pytest.approx(1 + 4 / 3)
    samples = {(family.name, sample.labels.get("position")): sample.value
               for family in _spec_decoding_metrics(stats, ["m"]) for sample in family.samples}
    assert samples[("pagedserve:spec_decode_num_accepted_tokens", None)] == 4
    assert samples[("pagedserve:spec_decode_num_accepted_tokens_per_pos", "2")] == 1
    assert samples[("pagedserve:spec_decode_num_drafted_tokens_per_pos", "2")] == 2


def test_memory_profile_step_runs_the_drafts_and_leaves_nothing_behind(llama_model, monkeypatch):
    """A GPU sizes its KV cache after one step of the largest batch: with a draft model, that step drafts too, into
    slots the throwaway cache holds, and forgets its requests after."""
    drafted: list[dict[str, list[int]]] = []
    real_propose = Speculator.propose
    monkeypatch.setattr(Speculator, "propose", lambda self, *args: drafted.append(real_propose(self, *args))
                        or drafted[-1])
    config = EngineConfig(model=llama_model, speculative_config=_draft_config("llama"), max_num_seqs=4,
                          max_num_batched_tokens=30, **ENGINE)
    executor = InProcessExecutor(config)
    try:
        runner = executor.worker.model_runner
        runner.profile_run()
        assert [len(draft) for draft in drafted[0].values()] == [3] * 4
        assert not runner.requests and not runner.speculator.proposer.fed and not runner.speculator.proposer.probs
    finally:
        executor.shutdown()
