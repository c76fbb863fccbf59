"""GGUF files: the engine equals HF transformers reading the same file (its own GGUF name mapping, q/k reordering and
gguf-package dequantization) on greedy tokens and their logprobs, float32; Q8_0 stays int8 in memory.

tests/data/llama-tiny-q8_0/model-q8_0.gguf was written by llama.cpp's converter (`python -m launch.make_gguf --model
<the model maker's tiny llama> --type q8_0`) and is committed so the loader is tested everywhere; the other files are
made here by llama.cpp's tools when LLAMA_CPP_DIR names a checkout with llama-quantize built (README: "GGUF files");
the Gemma 3 Q4_0 file by tests/gemma3_gguf.py (the gguf package's writer, llama.cpp's layout)."""
from __future__ import annotations

import functools
from pathlib import Path

import pytest

from conftest import _MODEL_ROOT, tiny_model
from frontend import LLM
from launch.make_gguf import LLAMA_CPP_ENV, llama_cpp_dir, make_gguf
from launch.make_model import make_model
from quantized_checkpoints import gguf_reference
from checkpoint_checks import assert_equals_reference
from gemma3_gguf import write_gemma3_gguf
from gguf import GGMLQuantizationType
from workers.model_config import load_hf_config

COMMITTED = Path(__file__).parent / "data" / "llama-tiny-q8_0"
COMMITTED_FILE = str(COMMITTED / "model-q8_0.gguf")
needs_llama_cpp = pytest.mark.skipif(llama_cpp_dir() is None,
                                     reason=f"llama.cpp's tools are optional: {LLAMA_CPP_ENV} is not set")


@functools.cache
def reference_of(path: str, tokenizer: str) -> str:
    return gguf_reference(path, tokenizer, _MODEL_ROOT / f"gguf-reference-{Path(path).parent.name}-{Path(path).stem}")


def test_committed_q8_0_file_equals_its_dequantized_reference():
    assert_equals_reference(COMMITTED_FILE, reference_of(COMMITTED_FILE, str(COMMITTED)), tokenizer=str(COMMITTED))


@functools.cache
def gemma3_q4_0() -> str:
    """The tiny Gemma 3 as its QAT checkpoints ship: Q4_0 GGUF (tests/gemma3_gguf.py), cached with the test models."""
    path = _MODEL_ROOT / "gemma3-tiny-q4_0" / "model-q4_0.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = write_gemma3_gguf(tiny_model("gemma3_text"), path.with_suffix(".partial"))
        partial.rename(path)
    return str(path)


def test_gemma3_q4_0_file_equals_its_dequantized_reference():
    """llama.cpp's Gemma 3 names, norms stored as 1 + w, Q4_0 projections dequantized at load: what transformers
    reads from the same file."""
    tokenizer = tiny_model("gemma3_text")
    assert_equals_reference(gemma3_q4_0(), reference_of(gemma3_q4_0(), tokenizer), tokenizer=tokenizer)


def test_gemma3_gguf_keeps_the_global_layers_rope_scaling():
    """A 4B-style file (six layers: five sliding, one global whose rope is scaled linearly by 8, which transformers'
    reading of a GGUF drops): the engine on the F32 file equals transformers on the original folder."""
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    folder = str(make_model(_MODEL_ROOT / "gemma3-tiny-rope8", arch="gemma3_text", size="tiny", num_hidden_layers=6,
                            layer_types=["sliding_attention"] * 5 + ["full_attention"], rope_parameters=rope))
    path = Path(folder) / "gguf" / "model-f32.gguf"
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        write_gemma3_gguf(folder, path.with_suffix(".partial"), GGMLQuantizationType.F32).rename(path)
    assert load_hf_config(str(path)).rope_parameters["full_attention"]["factor"] == 8.0
    assert_equals_reference(str(path), folder, tokenizer=folder)


def test_q8_0_weights_stay_int8():
    """Q8_0 projections hold one byte per weight plus a float32 scale per 32: well under float32's four bytes."""
    sizes = {}
    for name, model, tokenizer in (("q8_0", COMMITTED_FILE, str(COMMITTED)),
                                   ("float32", reference_of(COMMITTED_FILE, str(COMMITTED)), None)):
        llm = LLM(model, tokenizer=tokenizer, dtype="float32", in_process=True)
        sizes[name] = llm.info.weight_bytes
        llm.shutdown()
    projections = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128)  # 2 layers of q, o, k, v, gate, up, down
    assert sizes["float32"] - sizes["q8_0"] == projections * 4 - projections * (1 + 4 / 32)


@functools.cache
def llama_cpp_file(arch: str, kind: str) -> tuple[str, str]:
    """(GGUF file, tokenizer folder) made by llama.cpp from a random-weight model whose rows fit k-quants' 256."""
    model = make_model(_MODEL_ROOT / f"{arch}-tiny-k256", arch=arch, size="tiny", hidden_size=256,
                       intermediate_size=512, head_dim=64)
    return str(make_gguf(model, _MODEL_ROOT / f"{arch}-tiny-k256-gguf" / f"{kind}.gguf", kind)), str(model)


@needs_llama_cpp
@pytest.mark.parametrize("arch, kind", [("llama", "q8_0"), ("llama", "Q4_K_M"), ("llama", "Q5_K_M"),
                                        ("llama", "bf16"), ("qwen2", "Q4_K_M"), ("qwen2", "f16")])
def test_llama_cpp_files_equal_their_dequantized_reference(arch, kind):
    """Q4_K_M holds Q4_K and Q6_K tensors, Q5_K_M Q5_K and Q6_K; qwen2 adds q/k/v biases and a tied head (no
    output.weight in the file) and keeps its q/k rows in HF's order."""
    path, tokenizer = llama_cpp_file(arch, kind)
    assert_equals_reference(path, reference_of(path, tokenizer), tokenizer=tokenizer)


def test_a_gguf_model_needs_a_tokenizer_folder():
    with pytest.raises(ValueError, match="is a GGUF file: give tokenizer="):
        LLM(COMMITTED_FILE, dtype="float32", in_process=True)


def test_quantization_cannot_apply_to_a_gguf_file():
    with pytest.raises(ValueError, match="a GGUF file is loaded as its tensors are stored"):
        LLM(COMMITTED_FILE, tokenizer=str(COMMITTED), dtype="float32", in_process=True, quantization="int8")
    with pytest.raises(ValueError, match="quantization 'gguf' needs a .gguf file"):
        LLM(tiny_model("llama"), dtype="float32", in_process=True, quantization="gguf")
