"""Prompts given as embeddings (vLLM's prompt_embeds): offline and over /v1/completions with the official openai
client, greedy float32 output equal to the token prompt's (chunked, preempted, batched with token prompts, under
tp=2), never sharing cached blocks with token prompts; every bad input a 400 naming its field, and a pickle that is
not a tensor refused by the safe loader without being run."""
from __future__ import annotations

import base64
import io
import os
import pickle
import zipfile
from pathlib import Path

import msgspec
import openai
import pytest
import torch
from safetensors.torch import load_file

from conftest import API_KEY, assert_all_blocks_free, random_prompts, tiny_model
from frontend import LLM, SamplingParams
from frontend.api.errors import APIError
from frontend.api.prompt_embeds import embeds_list
from frontend.api.protocol import CompletionRequest
from ipc import Decoder, EngineCoreRequest, EngineInfo, Encoder, NewRequestData, PromptEmbeds
from launcher import start_launcher, stop_launcher
from workers.model_config import load_hf_config
from workers.models.registry import check_prompt_embeds
from workers.request_state import CachedRequestState
from workers.step_sampling import penalized_rows

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# 16 blocks of 8 tokens and 16-token steps: longer prompts run in chunks and requests get preempted; up to 8 decode
# steps in one call.
SMALL_ENGINE = {"dtype": "float32", "block_size": 8, "num_kv_blocks": 16, "max_model_len": 128,
                "max_num_batched_tokens": 16, "num_scheduler_steps": 8, "multi_step_budget_ms": None}


def embedding_table(model: str) -> torch.Tensor:
    """The model's input embedding (embed_tokens) as its checkpoint holds it."""
    return load_file(str(Path(model) / "model.safetensors"))["model.embed_tokens.weight"]


def saved(value) -> str:
    """`value` as a client sends prompt_embeds: torch.save'd, base64."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def llm():
    engine = LLM(tiny_model("llama"), in_process=True, enable_prompt_embeds=True, **SMALL_ENGINE)
    yield engine
    engine.shutdown()


def token_ids(outputs) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def test_embeddings_of_the_prompt_generate_what_its_ids_do_chunked_preempted_and_batched(llm):
    table = embedding_table(tiny_model("llama"))
    prompts = random_prompts([3, 20, 45, 70], vocab=1000, seed=3)
    # Token prompts and embedding prompts in one batch: 16-token steps chunk them, 16 blocks preempt some.
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts] + [{"prompt_embeds": table[p]} for p in prompts],
                           GREEDY, use_tqdm=False)
    assert token_ids(outputs[4:]) == token_ids(outputs[:4])
    assert llm.get_stats().num_preemptions > 0
    assert all(output.prompt_token_ids == [] for output in outputs[4:])  # no ids to report: placeholders are not
    perturbed = table[prompts[1]].clone()
    perturbed[-3:] += 0.5 * torch.randn(perturbed[-3:].shape, generator=torch.Generator().manual_seed(0))
    [changed] = llm.generate({"prompt_embeds": perturbed}, GREEDY, use_tqdm=False)
    assert changed.outputs[0].token_ids != outputs[1].outputs[0].token_ids  # the rows given are the rows used
    assert_all_blocks_free(llm)


@pytest.mark.slow  # a private Ray and two ranks start in about 40 s on 2 busy cores
def test_embeddings_reach_every_tensor_parallel_rank(llm):
    """They ride in the step's new-request data, which every rank gets: tp=2 writes what one rank does."""
    # Ray must take 127.0.0.1 as this machine's address (read when ray is imported): everything stays on loopback.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    table = embedding_table(tiny_model("llama"))
    prompts = random_prompts([3, 20, 45], vocab=1000, seed=3)
    expected = token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False))
    parallel = LLM(tiny_model("llama"), tensor_parallel_size=2, enable_prompt_embeds=True, **SMALL_ENGINE)
    try:
        assert token_ids(parallel.generate([{"prompt_embeds": table[p]} for p in prompts], GREEDY,
                                           use_tqdm=False)) == expected
        assert_all_blocks_free(parallel)
    finally:
        parallel.shutdown()


def test_decode_steps_after_an_embeddings_prefill_run_several_to_a_call(llm, monkeypatch):
    table = embedding_table(tiny_model("llama"))
    engine, calls = llm.client.engine, []
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: calls.append(1) or step())
    [prompt] = random_prompts([20], vocab=1000, seed=4)
    [output] = llm.generate({"prompt_embeds": table[prompt]}, SamplingParams(temperature=0.0, max_tokens=24,
                                                                             ignore_eos=True), use_tqdm=False)
    # Two chunks of the prompt (the second samples the first token), then 23 tokens in calls of 8 steps.
    assert len(output.outputs[0].token_ids) == 24 and len(calls) <= 6


def test_an_embeddings_prompt_shares_no_cached_block_with_the_placeholder_ids(llm):
    table = embedding_table(tiny_model("llama"))
    [prompt] = random_prompts([40], vocab=1000, seed=5)
    llm.generate({"prompt_embeds": table[prompt]}, GREEDY, use_tqdm=False)
    hits = llm.get_stats().prefix_cache_hits
    [zeros] = llm.generate({"prompt_token_ids": [0] * 40}, GREEDY, use_tqdm=False)
    assert llm.get_stats().prefix_cache_hits == hits  # its ids are the placeholders; its blocks are not theirs
    [again] = llm.generate({"prompt_embeds": table[prompt]}, GREEDY, use_tqdm=False)
    assert llm.get_stats().prefix_cache_hits == hits and again.num_cached_tokens == 0
    assert_all_blocks_free(llm)


def test_penalties_and_bad_words_do_not_read_the_placeholder_ids(llm):
    """Placeholder id 0 is not in the prompt: the repetition penalty leaves it alone (the logit biases make it the
    favourite by a margin that a penalty of 2 over a seen token would reverse), and a bad word after it is not."""
    table = embedding_table(tiny_model("llama"))
    [prompt] = random_prompts([6], vocab=1000, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logit_bias={0: 100.0, 5: 80.0},
                            repetition_penalty=2.0)
    [output] = llm.generate({"prompt_embeds": table[prompt]}, params, use_tqdm=False)
    assert output.outputs[0].token_ids == [0]
    params = SamplingParams(max_tokens=4, bad_words_token_ids=[[0, 5]])
    data = NewRequestData(req_id="r", prompt_token_ids=[0] * 2, sampling_params=params, eos_token_id=None,
                          block_ids=[], num_computed_tokens=0, prompt_embeds=PromptEmbeds.of(torch.zeros(2, 64)))
    state = CachedRequestState.from_new(data)
    assert state.banned_token_ids() == [] and state.banned_token_ids([0]) == [5]
    state.token_ids.append(7)
    assert penalized_rows([state], [[9]]).prompt == [[]] and penalized_rows([state], [[9]]).output == [[7, 9]]


@pytest.mark.parametrize("embeds, params, param, words", [
    (torch.zeros(4, 63), GREEDY, "prompt_embeds", "hidden size"),
    (torch.zeros(128, 64), GREEDY, "prompt_embeds", "max_model_len"),
    (torch.zeros(4, 64), SamplingParams(max_tokens=4, prompt_logprobs=1), "prompt_logprobs", "not defined"),
])
def test_embeddings_the_engine_cannot_take_are_refused_by_name(llm, embeds, params, param, words):
    with pytest.raises(ValueError, match=words) as raised:
        llm.generate({"prompt_embeds": embeds}, params, use_tqdm=False)
    assert getattr(raised.value, "param", param) == param
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("embeds", [torch.zeros(64), torch.zeros(1, 4, 64), torch.zeros(4, 64, dtype=torch.int64),
                                    torch.full((4, 64), float("nan")), [[0.0] * 64]])
def test_only_2d_floating_finite_tensors_are_prompt_embeds(embeds):
    with pytest.raises(ValueError, match="prompt_embeds"):
        PromptEmbeds.of(embeds)


def test_embeddings_travel_as_raw_bytes_and_a_short_frame_is_refused():
    embeds = torch.randn(3, 8, dtype=torch.bfloat16)
    request = EngineCoreRequest(request_id="r", prompt_token_ids=[0] * 3, sampling_params=GREEDY,
                                prompt_embeds=PromptEmbeds.of(embeds))
    frames = Encoder().encode(request)
    decoded = Decoder(EngineCoreRequest).decode(frames)
    assert torch.equal(decoded.prompt_embeds.tensor(), embeds)
    short = msgspec.msgpack.encode({"data": request.prompt_embeds.data[:-2], "dtype": "bfloat16", "shape": [3, 8]})
    with pytest.raises(msgspec.ValidationError, match="take 48 bytes"):
        msgspec.msgpack.decode(short, type=PromptEmbeds)


def test_an_engine_without_the_flag_refuses_embeddings():
    info = EngineInfo(model="m", max_model_len=64, vocab_size=100, num_kv_blocks=8, block_size=16,
                      scheduling_policy="fcfs", hidden_size=8)
    request = EngineCoreRequest(request_id="r", prompt_token_ids=[0] * 2, sampling_params=GREEDY,
                                prompt_embeds=PromptEmbeds.of(torch.zeros(2, 8)))
    with pytest.raises(ValueError, match="--enable-prompt-embeds") as raised:
        info.validate_request(request)
    assert raised.value.param == "prompt_embeds"
    with pytest.raises(APIError, match="--enable-prompt-embeds") as refused:
        embeds_list(CompletionRequest(prompt_embeds=saved(torch.zeros(2, 8))), info)
    assert (refused.value.status, refused.value.param) == (400, "prompt_embeds")


def test_the_llama_family_takes_embeddings_and_another_family_is_named():
    for arch in ("llama", "qwen2", "mistral", "qwen3"):
        check_prompt_embeds(load_hf_config(tiny_model(arch)))
    with pytest.raises(ValueError, match="Gemma2ForCausalLM family does not take prompt embeddings"):
        check_prompt_embeds(load_hf_config(tiny_model("gemma2")))


# --- over HTTP -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served():
    """(openai client, embedding table, token prompts and their greedy outputs) of the tiny llama served with
    --enable-prompt-embeds."""
    model = tiny_model("llama")
    process, base_url = start_launcher(["--model", model, "--dtype", "float32", "--max-model-len", "128",
                                        "--api-key", API_KEY, "--enable-prompt-embeds"])
    yield openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0), embedding_table(model)
    stop_launcher(process)


def test_completions_with_prompt_embeds_equal_the_token_prompt_whole_and_streamed(served):
    client, table = served
    prompts = random_prompts([5, 30], vocab=1000, seed=7)
    asked = dict(model=tiny_model("llama"), max_tokens=6, temperature=0)
    expected = [client.completions.create(prompt=p, **asked).choices[0].text for p in prompts]
    whole = client.completions.create(prompt="", extra_body={"prompt_embeds": [saved(table[p]) for p in prompts]},
                                      **asked)
    assert [choice.text for choice in sorted(whole.choices, key=lambda c: c.index)] == expected
    assert whole.usage.prompt_tokens == 35
    stream = client.completions.create(prompt="", stream=True, extra_body={"prompt_embeds": saved(table[prompts[1]])},
                                       **asked)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected[1]


class _Marker:
    """Unpickling one would create a file: the safe loader must refuse it, not build it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def test_bad_prompt_embeds_are_400s_naming_the_field(served, tmp_path):
    client, _ = served
    marker = tmp_path / "unpickled"
    zip_pickle, deflated = io.BytesIO(), io.BytesIO()
    torch.save({"x": _Marker(str(marker))}, zip_pickle)
    with zipfile.ZipFile(io.BytesIO(base64.b64decode(saved(torch.zeros(2, 64))))) as source, \
            zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as target:
        for entry in source.infolist():
            target.writestr(entry.filename, source.read(entry))
    cases = [
        ("not base64 at all!", "prompt_embeds", "not base64"),
        (base64.b64encode(pickle.dumps(_Marker(str(marker)))).decode(), "prompt_embeds", "zip format"),
        (base64.b64encode(zip_pickle.getvalue()).decode(), "prompt_embeds", "objects other than tensors"),
        (base64.b64encode(deflated.getvalue()).decode(), "prompt_embeds", "compressed"),
        (saved({"embeds": torch.zeros(2, 64)}), "prompt_embeds", "torch.Tensor"),
        (saved(torch.zeros(64)), "prompt_embeds", "2-D"),
        (saved(torch.zeros(3, 32)), "prompt_embeds", "hidden size"),
        (saved(torch.zeros(128, 64)), "prompt_embeds", "context length"),
        ("A" * 200_000, "prompt_embeds", "over this model's"),
    ]
    for value, param, words in cases:
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model=tiny_model("llama"), prompt="", max_tokens=2,
                                      extra_body={"prompt_embeds": value})
        error = raised.value.body
        assert error["param"] == param and words in error["message"], (words, error)
    assert not marker.exists()  # nothing of the client's pickle was built
    for prompt, extra, param in (("hi", {}, "prompt_embeds"), ("", {"echo": True}, "echo"),
                                 ("", {"prompt_logprobs": 1}, "prompt_logprobs")):
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model=tiny_model("llama"), prompt=prompt, max_tokens=2,
                                      extra_body={"prompt_embeds": saved(torch.zeros(2, 64)), **extra})
        assert raised.value.body["param"] == param, raised.value.body
