"""load_format="dummy": a folder with a config and tokenizer but no weights serves random weights of its shapes
(benchmarks of models too large to write out), drawn the same way on every load."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_all_blocks_free
from frontend import LLM, SamplingParams
from ipc import EngineConfig
from launch.make_model import make_model
from workers.model_config import load_hf_config
from workers.model_loader import DUMMY_STD, fill_dummy_weights
from workers.models import get_model_class


@pytest.fixture(scope="module")
def weightless_model(tmp_path_factory) -> str:
    return str(make_model(tmp_path_factory.mktemp("weightless") / "llama", size="tiny", weights=False))


def test_a_folder_without_weights_serves_random_weights_of_its_shapes(weightless_model):
    llm = LLM(weightless_model, in_process=True, load_format="dummy", dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    [output] = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 12
    model = llm.client.engine.executor.worker.model_runner.model
    for name, param in model.named_parameters():
        if "norm" in name:
            assert torch.all(param == 1), name
        else:
            assert param.std().item() == pytest.approx(DUMMY_STD, rel=0.2), name
    assert_all_blocks_free(llm)
    llm.shutdown()


def test_dummy_weights_repeat_on_every_load(weightless_model):
    config = load_hf_config(weightless_model)
    first, second = (get_model_class(config)(config) for _ in range(2))
    fill_dummy_weights(first)
    fill_dummy_weights(second)
    for (name, a), b in zip(first.named_parameters(), second.parameters()):
        assert torch.equal(a, b), name


def test_without_dummy_a_folder_without_weights_is_a_clear_error(weightless_model):
    with pytest.raises(ValueError, match="no \\*.safetensors weight files"):
        LLM(weightless_model, in_process=True)


def test_dummy_weights_refuse_a_quantized_checkpoints_config(tmp_path):
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
    folder = make_model(tmp_path / "gptq", size="tiny", weights=False, quantization_config=gptq)
    with pytest.raises(ValueError, match="dummy weights are plain weights"):
        LLM(str(folder), in_process=True, load_format="dummy")


def test_an_unknown_load_format_names_the_field():
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(model="unused", load_format="pt")
