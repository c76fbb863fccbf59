"""Checks the quantized-checkpoint tests share: a folder's greedy tokens and logprobs against its float32
reference, edited copies of a folder, and the error a folder fails to load with."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import random_prompts
from frontend import LLM, SamplingParams
from hf_reference import hf_greedy, hf_logprobs

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)


def assert_equals_reference(quantized: str, reference: str, **engine_args) -> None:
    prompts = random_prompts([3, 40, 150], vocab=1000)
    llm = LLM(quantized, dtype="float32", in_process=True, **engine_args)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        assert completion.token_ids == hf_greedy(reference, prompt, GREEDY.max_tokens), f"{len(prompt)}-token prompt"
        expected = hf_logprobs(reference, prompt + completion.token_ids, len(prompt))
        got = [entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)]
        torch.testing.assert_close(torch.tensor(got), expected.gather(1, torch.tensor(completion.token_ids)[:, None])
                                   .squeeze(1), atol=1e-4, rtol=0)


def copy_folder(source: str, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def edit_quantization_config(folder: Path, edit) -> None:
    config = json.loads((folder / "config.json").read_text())
    edit(config["quantization_config"])
    (folder / "config.json").write_text(json.dumps(config))


def load_error(folder: Path | str, **engine_args) -> str:
    with pytest.raises(ValueError) as error:
        LLM(str(folder), dtype="float32", in_process=True, **engine_args)
    return str(error.value)
