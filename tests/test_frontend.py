"""Front end: incremental detokenization, stop strings and stop tokens, chat templates, output order."""
from __future__ import annotations

import gc
import json
import shutil
import weakref

import pytest

from conftest import assert_all_blocks_free, random_prompts
from frontend import LLM, SamplingParams
from frontend.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def llm(llama_model):
    llm = LLM(llama_model, dtype="float32")
    yield llm
    llm.shutdown()


TEXT = "Grüße aus Köln — 日本語のテキスト, emoji 😀🚀 and ascii."


def test_incremental_detokenizer_is_exact_on_multibyte_text(llm):
    ids = llm.tokenizer.encode(TEXT)
    assert len(ids) > 10
    detokenizer = IncrementalDetokenizer(llm.tokenizer, SamplingParams(), prompt_token_ids=[])
    pieces = [detokenizer.add_token(t) for t in ids]
    assert all(p is None for p in pieces)
    assert detokenizer.text == llm.tokenizer.decode(ids) == TEXT
    assert "\ufffd" not in detokenizer.text, "a split UTF-8 character leaked out as a replacement char"


def test_a_prompt_ending_inside_a_character_does_not_leak_into_the_output(llm):
    """Every split point of multi-byte text as the prompt's end: the output text is what its own tokens decode
    to (after the prompt's dangling bytes), never prompt text."""
    ids = llm.tokenizer.encode(TEXT)
    answer = llm.tokenizer.encode(" and more")
    dangling = [cut for cut in range(1, len(ids)) if llm.tokenizer.decode(ids[:cut]).endswith("\ufffd")]
    assert dangling, "the test text has no character split across tokens"
    for cut in dangling:
        detokenizer = IncrementalDetokenizer(llm.tokenizer, SamplingParams(), prompt_token_ids=ids[:cut])
        for token in answer:
            detokenizer.add_token(token)
        assert detokenizer.text == llm.tokenizer.decode(answer), cut


def greedy_reference(llm, max_tokens=32):
    prompt = {"prompt_token_ids": random_prompts([20], vocab=1000, seed=5)[0]}
    [out] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                         use_tqdm=False)
    return prompt, out.outputs[0]


def test_stop_string_is_cut_reported_and_aborts_the_engine(llm):
    prompt, full = greedy_reference(llm)
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    cut = full.text.index(stop)
    for include, expected in ((False, full.text[:cut]), (True, full.text[:cut + len(stop)])):
        params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=[stop, "never-there"],
                                include_stop_str_in_output=include)
        [out] = llm.generate(prompt, params, use_tqdm=False)
        completion = out.outputs[0]
        assert (completion.text, completion.finish_reason, completion.stop_reason) == (expected, "stop", stop)
        assert full.token_ids[:len(completion.token_ids)] == completion.token_ids
        assert len(completion.token_ids) < len(full.token_ids)
        assert_all_blocks_free(llm)


def test_stop_token_ids(llm):
    prompt, full = greedy_reference(llm)
    stop_token = full.token_ids[6]
    first = full.token_ids.index(stop_token)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop_token_ids=[stop_token])
    [out] = llm.generate(prompt, params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.token_ids == full.token_ids[:first + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop_token)
    decoded = llm.tokenizer.decode(full.token_ids[:first])
    # A partial UTF-8 character at the very end is held back, where decode() shows U+FFFD.
    assert decoded.startswith(completion.text) and set(decoded[len(completion.text):]) <= {"\ufffd"}


def test_outputs_keep_input_order_and_fields(llama_model):
    llm = LLM(llama_model, dtype="float32", scheduling_policy="priority")
    prompts = ["Hello, my name is", {"prompt_token_ids": [1, 2, 3]}, {"prompt": "def f(x):"}]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (9, 3, 6)]
    outputs = llm.generate(prompts, params, use_tqdm=False, priority=[2, 1, 0])
    assert [len(o.outputs[0].token_ids) for o in outputs] == [9, 3, 6]
    assert [o.prompt for o in outputs] == ["Hello, my name is", None, "def f(x):"]
    assert outputs[0].prompt_token_ids == llm.tokenizer.encode("Hello, my name is")
    first = outputs[0].outputs[0]
    assert first.index == 0 and first.cumulative_logprob is None and first.logprobs is None
    assert first.text == llm.tokenizer.decode(first.token_ids, skip_special_tokens=True)
    assert all(o.finished and o.num_cached_tokens == 0 for o in outputs)


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "hi"}]
    [out] = llm.chat(messages, SamplingParams(max_tokens=4), use_tqdm=False)
    rendered = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt == rendered
    assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert len(llm.chat([messages, messages], use_tqdm=False)) == 2


def test_chat_without_template_is_a_clear_error(llama_model, tmp_path):
    folder = tmp_path / "no-template"
    shutil.copytree(llama_model, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    llm = LLM(str(folder), dtype="float32")
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("in_process", [False, True])
def test_an_error_mid_generation_returns_every_block(llama_model, monkeypatch, in_process):
    llm = LLM(llama_model, dtype="float32", in_process=in_process)
    real_get_outputs, calls = llm.client.get_outputs, []

    def failing_get_outputs():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # e.g. Ctrl-C while the batch is half done
        return real_get_outputs()

    monkeypatch.setattr(llm.client, "get_outputs", failing_get_outputs)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["one", "two", "three"], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert_all_blocks_free(llm)
    assert not llm.router.has_requests() and not llm.router.output_processor.states
    monkeypatch.undo()
    [again] = llm.generate("one", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(again.outputs[0].token_ids) == 3


def test_in_process_shutdown_frees_the_model_while_the_llm_lives(llama_model):
    """So a process can start its next engine straight away (on a GPU: the memory is back)."""
    llm = LLM(llama_model, dtype="float32", in_process=True)
    model = weakref.ref(llm.client.engine.executor.worker.model_runner.model)
    llm.shutdown()
    gc.collect()
    assert model() is None
