"""--generation-config: a model's generation_config.json as sampling defaults (vLLM's rule), read robustly."""
from __future__ import annotations

import json
import logging
import shutil

import pytest

from frontend import LLM, SamplingParams
from frontend.generation_config import (
    apply_generation_defaults, load_generation_defaults, model_stop_token_ids, with_stop_token_ids)

RECOMMENDED = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
               "max_new_tokens": 64}


def _folder(tmp_path, config: dict | str, name: str = "model"):
    folder = tmp_path / name
    folder.mkdir()
    text = config if isinstance(config, str) else json.dumps(config)
    (folder / "generation_config.json").write_text(text)
    return folder


def test_auto_takes_the_sampling_keys_vllm_takes_whatever_do_sample_says(tmp_path):
    folder = _folder(tmp_path, {**RECOMMENDED, "do_sample": False, "bos_token_id": 0, "num_beams": 4})
    defaults = load_generation_defaults(str(folder), "auto")
    expected = {("max_tokens" if key == "max_new_tokens" else key): value for key, value in RECOMMENDED.items()}
    assert defaults == expected
    assert isinstance(defaults["top_k"], int) and isinstance(defaults["max_tokens"], int)


def test_vllm_mode_gives_no_defaults_and_a_folder_mode_reads_that_folder(tmp_path):
    model = _folder(tmp_path, RECOMMENDED)
    other = _folder(tmp_path, {"temperature": 0.2}, name="other")
    assert load_generation_defaults(str(model), "vllm") == {}
    assert load_generation_defaults(str(model), str(other)) == {"temperature": 0.2}


def test_a_named_folder_without_a_readable_file_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_generation_defaults("unused", str(tmp_path))
    broken = _folder(tmp_path, "{not json")
    with pytest.raises(ValueError, match="--generation-config .*JSON"):
        load_generation_defaults("unused", str(broken))


def test_auto_survives_a_missing_or_broken_file(tmp_path, caplog):
    assert load_generation_defaults(str(tmp_path), "auto") == {}  # no file: nothing to say
    assert not caplog.records
    for index, text in enumerate(("{not json", "[1, 2]", "\xff\xfe")):
        folder = tmp_path / f"broken{index}"
        folder.mkdir()
        (folder / "generation_config.json").write_bytes(text.encode("latin-1"))
        with caplog.at_level(logging.WARNING, logger="pagedserve.generation_config"):
            assert load_generation_defaults(str(folder), "auto") == {}
        assert "generation_config.json" in caplog.records[-1].getMessage()


def test_values_the_sampler_would_refuse_are_skipped_with_a_warning(tmp_path, caplog):
    folder = _folder(tmp_path, {"temperature": -1, "top_p": "high", "top_k": 2.5, "min_p": True,
                                "repetition_penalty": 1.2, "max_new_tokens": 0})
    with caplog.at_level(logging.WARNING, logger="pagedserve.generation_config"):
        assert load_generation_defaults(str(folder), "auto") == {"repetition_penalty": 1.2}
    warned = " ".join(record.getMessage() for record in caplog.records)
    for key in ("temperature", "top_p", "top_k", "min_p", "max_new_tokens"):
        assert f"ignoring {key}=" in warned


def test_the_defaults_in_use_are_logged_at_start(tmp_path, caplog):
    folder = _folder(tmp_path, {"temperature": 0.7, "max_new_tokens": 10.0})
    with caplog.at_level(logging.INFO, logger="pagedserve.generation_config"):
        assert load_generation_defaults(str(folder), "auto") == {"temperature": 0.7, "max_tokens": 10}
    assert "'temperature': 0.7" in caplog.text and "--generation-config vllm" in caplog.text


def test_defaults_fill_only_what_a_request_left_out():
    fields = {"temperature": None, "top_p": 0.5, "top_k": None, "max_tokens": 7}
    defaults = {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64, "min_p": 0.1}
    assert apply_generation_defaults(fields, defaults) == {"temperature": 0.6, "top_p": 0.5, "top_k": None,
                                                           "max_tokens": 7, "min_p": 0.1}
    assert apply_generation_defaults(fields, {}) == fields


def test_llm_samples_as_the_models_generation_config_unless_told_otherwise(llama_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(llama_model, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    llm = LLM(str(model), dtype="float32", in_process=True)
    assert (llm.default_sampling_params.temperature, llm.default_sampling_params.max_tokens) == (0.0, 5)
    [greedy] = llm.generate("Once upon a time", use_tqdm=False)
    [again] = llm.generate("Once upon a time", use_tqdm=False)
    assert len(greedy.outputs[0].token_ids) <= 5 and greedy.outputs[0].token_ids == again.outputs[0].token_ids
    plain = LLM(str(model), dtype="float32", in_process=True, generation_config="vllm").default_sampling_params
    assert plain == SamplingParams()


def test_the_generation_configs_other_eos_ids_are_stop_tokens(tmp_path):
    assert model_stop_token_ids(str(_folder(tmp_path, {"eos_token_id": [0, 7, 7, True, -1, "x", 9]})), 0) == [7, 9]
    assert model_stop_token_ids(str(_folder(tmp_path, {"eos_token_id": 5}, "one")), 0) == [5]
    assert model_stop_token_ids(str(_folder(tmp_path, {"eos_token_id": 0}, "same")), 0) == []
    assert model_stop_token_ids(str(_folder(tmp_path, "{broken", "broken")), 0) == []
    assert model_stop_token_ids(str(tmp_path / "nowhere"), 0) == []
    assert with_stop_token_ids(SamplingParams(stop_token_ids=[9, 3]), [7, 9]).stop_token_ids == [9, 3, 7]
    assert with_stop_token_ids(SamplingParams(ignore_eos=True), [7]).stop_token_ids is None


def test_a_request_stops_at_the_generation_configs_end_of_turn_token(llama_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(llama_model, model)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    [free] = LLM(str(model), dtype="float32", in_process=True).generate("Once upon a time", greedy, use_tqdm=False)
    tokens = free.outputs[0].token_ids
    end = next(i for i, t in enumerate(tokens) if i > 0 and t not in tokens[:i])  # its first occurrence
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, tokens[end]]}))
    llm = LLM(str(model), dtype="float32", in_process=True)
    [stopped] = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert stopped.outputs[0].token_ids == tokens[:end + 1]
    assert (stopped.outputs[0].finish_reason, stopped.outputs[0].stop_reason) == ("stop", tokens[end])
    [through] = llm.generate("Once upon a time", greedy, use_tqdm=False)  # ignore_eos runs past it, as past EOS
    assert through.outputs[0].token_ids == tokens
