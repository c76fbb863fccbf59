"""One request group for every front end: n fan-out, child ids, merged outputs, abort on release, one final output."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from conftest import AUTH, engine_slowed, metric, wait_until
from frontend import LLM, SamplingParams
from frontend.output_collector import RequestOutputCollector
from frontend.outputs import CompletionOutput, RequestOutput
from frontend.request_group import RequestGroup
from frontend.request_router import RequestRouter
from frontend.tokenizer import load_tokenizer
from ipc import EngineCoreOutput, EngineInfo, FinishReason, RequestError, RequestOutputKind

FINAL, DELTA = RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA


def _output(text: str, finished: bool, request_id: str = "c") -> RequestOutput:
    completion = CompletionOutput(0, text, [len(text)], None, None, "length" if finished else None)
    return RequestOutput(request_id, "p", [1], [completion], finished)


def test_final_only_group_gives_one_output_of_all_samples_in_index_order():
    delivered = []
    group = RequestGroup("r", SamplingParams(n=3, output_kind=FINAL), delivered.append)
    for index in (2, 0, 1):
        group.child_output(index, _output(f"sample{index}", True))
    group.fail(RuntimeError("too late"))
    group.child_output(0, _output("again", True))
    [merged] = delivered
    assert merged.request_id == "r" and merged.finished
    assert [(c.index, c.text) for c in merged.outputs] == [(0, "sample0"), (1, "sample1"), (2, "sample2")]


def test_streamed_group_marks_each_sample_and_finishes_once():
    delivered = []
    group = RequestGroup("r", SamplingParams(n=2, output_kind=DELTA), delivered.append)
    group.child_output(1, _output("a", False))
    group.child_output(1, _output("b", True))
    group.child_output(0, _output("c", True))
    assert [(o.request_id, o.outputs[0].index, o.outputs[0].text, o.finished) for o in delivered] == [
        ("r", 1, "a", False), ("r", 1, "b", False), ("r", 0, "c", True)]


def test_collector_merges_a_slow_consumers_deltas_per_sample_and_keeps_the_final_last():
    async def run():
        collector = RequestOutputCollector(DELTA)
        first, final = _output("x", False), _output("z", True)
        collector.put(first)                       # sample 0
        second = _output("y", False)
        second.outputs[0].index = 1
        collector.put(second)                      # sample 1
        collector.put(final)                       # sample 0 again: merged with "x", moved behind sample 1
        return [await collector.get() for _ in range(2)]
    one, two = asyncio.run(run())
    assert (one.outputs[0].index, one.outputs[0].text, one.finished) == (1, "y", False)
    assert (two.outputs[0].index, two.outputs[0].text, two.finished) == (0, "xz", True)


class _Client:
    def __init__(self) -> None:
        self.sent, self.aborted = [], []

    def add_request(self, request) -> None:
        self.sent.append(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.aborted += request_ids


@pytest.fixture
def router(llama_model):
    tokenizer = load_tokenizer(llama_model)
    info = EngineInfo(model=llama_model, max_model_len=64, vocab_size=len(tokenizer), num_kv_blocks=8, block_size=16,
                      scheduling_policy="fcfs")
    return RequestRouter(_Client(), tokenizer, info)


def test_router_sends_n_children_with_their_own_ids_and_seeds_and_release_aborts_them(router):
    delivered = []
    group = router.add("r", {"prompt_token_ids": [5, 6]}, SamplingParams(n=3, seed=7, output_kind=FINAL),
                       delivered.append)
    assert [(r.request_id, r.sampling_params.n, r.sampling_params.seed) for r in router.client.sent] == [
        ("r#0", 1, 7), ("r#1", 1, 8), ("r#2", 1, 9)]
    with pytest.raises(ValueError, match="already in use"):
        router.add("r", {"prompt_token_ids": [5]}, SamplingParams(), delivered.append)
    router.route([EngineCoreOutput(request_id="r#1", new_token_ids=[9], finish_reason=FinishReason.LENGTH)])
    router.release(group)
    assert sorted(router.client.aborted) == ["r#0", "r#2"] and delivered == []
    assert not router.groups and not router.children and not router.output_processor.states


def test_one_failed_child_fails_the_request_once_and_aborts_its_siblings(router):
    delivered = []
    router.add("r", {"prompt_token_ids": [5]}, SamplingParams(n=3, output_kind=DELTA), delivered.append)
    strays = router.route_errors([RequestError(request_id="r#1", kind="failed", message="boom"),
                                  RequestError(request_id="r#2", kind="failed", message="boom again"),
                                  RequestError(request_id="other", message="not ours")])
    assert [s.request_id for s in strays] == ["r#2", "other"]  # r#2 was aborted with its group
    assert len(delivered) == 1 and "boom" in str(delivered[0])
    assert sorted(router.client.aborted) == ["r#0", "r#2"] and not router.groups and not router.children


def test_abort_ends_every_sample_with_one_final_output(router):
    delivered = []
    router.add("r", {"prompt_token_ids": [5]}, SamplingParams(n=2, output_kind=FINAL), delivered.append)
    router.route([EngineCoreOutput(request_id="r#0", new_token_ids=[9], finish_reason=FinishReason.LENGTH)])
    router.abort("r")
    [final] = delivered
    assert [c.finish_reason for c in final.outputs] == ["length", "abort"] and final.finished
    assert router.client.aborted == ["r#1"] and not router.groups and not router.children


# -- through the gateway, with the official client -------------------------------------------------------------------
def test_n3_streams_per_index_deltas_that_add_up_to_the_plain_response(client, llama_model):
    kwargs = dict(model=llama_model, prompt="Once upon", max_tokens=6, n=3, temperature=1.0, seed=11,
                  extra_body={"ignore_eos": True})
    texts, finishes = {0: "", 1: "", 2: ""}, {}
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            assert choice.index not in finishes  # nothing after a choice's finish
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    plain = client.completions.create(**kwargs)
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert [texts[i] for i in range(3)] == [c.text for c in sorted(plain.choices, key=lambda c: c.index)]
    assert len(set(texts.values())) == 3


def test_a_request_without_model_uses_the_served_one(server):
    response = httpx.post(f"{server[1]}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_echo_returns_the_prompt_and_its_logprobs(client, llama_model):
    prompt = "The cat sat on"
    plain = client.completions.create(model=llama_model, prompt=prompt, max_tokens=3, temperature=0, logprobs=2)
    echoed = client.completions.create(model=llama_model, prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                                       echo=True)
    [choice] = echoed.choices
    assert choice.text == prompt + plain.choices[0].text
    logprobs, num_prompt = choice.logprobs, echoed.usage.prompt_tokens
    assert len(logprobs.tokens) == num_prompt + 3 and logprobs.token_logprobs[0] is None
    assert logprobs.token_logprobs[num_prompt:] == plain.choices[0].logprobs.token_logprobs
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    llm = LLM(llama_model, dtype="float32", in_process=True)
    ids = llm.get_tokenizer().encode(prompt)
    [reference] = llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    expected = [entry[token].logprob for token, entry in zip(ids[1:], reference.prompt_logprobs[1:])]
    assert logprobs.token_logprobs[1:num_prompt] == pytest.approx(expected, abs=1e-4)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=llama_model, prompt=prompt, max_tokens=3, temperature=0, echo=True, stream=True))
    assert streamed == choice.text


def test_a_stream_of_n3_dropped_mid_way_aborts_all_three_and_frees_every_block(server, llama_model):
    aborted = metric(server[1], "pagedserve:num_aborted_requests_total")
    body = {"model": llama_model, "prompt": "go on", "max_tokens": 900, "n": 3, "stream": True, "ignore_eos": True,
            "logprobs": 20}
    # Unslowed, a machine ran the three samples' 2700 tokens in a third of a second, before the hang-up reached it.
    with engine_slowed(server, body):
        with httpx.stream("POST", f"{server[1]}/v1/completions", json=body, headers=AUTH) as response:
            seen = set()
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    seen.add(httpx.Response(200, content=line[6:]).json()["choices"][0]["index"])
                if len(seen) == 3:
                    break
        assert wait_until(lambda: metric(server[1], "pagedserve:num_aborted_requests_total") == aborted + 3,
                          timeout=30)
    assert wait_until(lambda: metric(server[1], "pagedserve:kv_cache_usage_perc") == 0.0, timeout=10)
    assert metric(server[1], "pagedserve:num_requests_running") == 0
