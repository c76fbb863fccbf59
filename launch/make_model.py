"""The model maker: random-weight HuggingFace model folders with a locally trained BPE tokenizer."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from launch.make_tokenizer import train_tokenizer
from launch.model_shapes import ENDOFTEXT_ID, INIT_STD, SIZE_OVERRIDES, SIZES, config_kwargs

MAKER_VERSION = 3  # 2: tools in the chat template, <think> and </think> tokens; 3: a call right after the role
MARKER_FILE = "pagedserve_model.json"
ARCHS = ("llama", "qwen2", "mistral", "opt", "qwen3", "phi3", "gpt_neox", "mixtral", "qwen2_moe", "qwen3_moe",
         "deepseek_v2", "deepseek_v3", "gemma2", "gemma3_text")

def make_model(
    out_dir: str | Path, arch: str = "llama", size: str = "tiny", seed: int = 0, random_biases: bool = False,
    weights: bool = True, **config_overrides: Any
) -> Path:
    """Write a random-weight model folder at `out_dir`, or reuse the one already made from this spec.
    HF initialises biases to zero; `random_biases` draws them too, so a test sees how they are added. Without
    `weights` the folder holds the config and tokenizer only (served with load_format="dummy")."""
    _check_choice("arch", arch, ARCHS)
    _check_choice("size", size, tuple(SIZES))
    spec = _spec(arch, size, seed, SIZE_OVERRIDES.get(size, {}) | config_overrides, random_biases, weights)
    return write_model_folder(out_dir, spec, _write_model)


def write_model_folder(out_dir: str | Path, spec: dict[str, Any], write: Callable[[Path, dict[str, Any]], None]
                       ) -> Path:
    """The folder at `out_dir` made by `write(folder, spec)` in a temporary folder moved into place, or the one
    already there when its marker holds this spec."""
    out = Path(out_dir).expanduser().resolve()
    if _read_marker(out) == spec:
        return out
    _check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the finished folder should not be
    try:
        write(tmp, spec)
        _move_into_place(tmp, out, spec)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def benchmark_cache_dir() -> Path:
    """Where benchmark models live: $PAGEDSERVE_CACHE, else ~/.cache/pagedserve."""
    return Path(os.environ.get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve").expanduser()


def default_benchmark_model_dir() -> Path:
    """Where the benchmarks' model lives: benchmark-model in benchmark_cache_dir()."""
    return benchmark_cache_dir() / "benchmark-model"


def ensure_benchmark_model() -> Path:
    """The random-weight ~30M llama the benchmarks time (its speed, not its words) unless already on disk."""
    return make_model(default_benchmark_model_dir(), "llama", "30m")


def _check_choice(field: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {field} {value!r}; choose one of: {', '.join(allowed)}")


def _spec(arch: str, size: str, seed: int, overrides: dict[str, Any], random_biases: bool,
          weights: bool) -> dict[str, Any]:
    spec = {"maker_version": MAKER_VERSION, "arch": arch, "size": size, "seed": seed, "overrides": overrides}
    # Each only when set: folders made before the option still match their markers.
    if random_biases:
        spec["random_biases"] = True
    if not weights:
        spec["weights"] = False
    # Round-trip through JSON so the spec compares equal to the marker read back from disk.
    return json.loads(json.dumps(spec, sort_keys=True))


def _read_marker(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / MARKER_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError):
        return {}


def _check_replaceable(out: Path) -> None:
    """Only an empty folder or one of our own model folders may be replaced."""
    if out.exists() and _read_marker(out) is None and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not a pagedserve model folder; choose a new or empty one")


def _move_into_place(tmp: Path, out: Path, spec: dict[str, Any]) -> None:
    if _read_marker(out) == spec:
        return  # another process made the same model meanwhile
    if out.exists():
        shutil.rmtree(out)
    try:
        os.replace(tmp, out)
    except OSError:
        if _read_marker(out) != spec:
            raise


def _write_model(folder: Path, spec: dict[str, Any]) -> None:
    size = SIZES[spec["size"]]
    tokenizer = train_tokenizer(size.vocab)
    tokenizer.model_max_length = size.max_positions
    kwargs = config_kwargs(spec["arch"], size, len(tokenizer)) | spec["overrides"]
    config = AutoConfig.for_model(spec["arch"], **kwargs)
    generation_config = GenerationConfig(bos_token_id=ENDOFTEXT_ID, eos_token_id=ENDOFTEXT_ID,
                                         pad_token_id=ENDOFTEXT_ID)
    with quiet_transformers(), torch.random.fork_rng(devices=[]):
        if spec.get("weights", True):
            torch.manual_seed(spec["seed"])
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            if spec.get("random_biases"):
                _randomize_biases(model)
            _draw_routing_biases(model)
            model.generation_config = generation_config
            model.save_pretrained(folder)
        else:
            config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]  # as save_pretrained writes
            config.save_pretrained(folder)
            generation_config.save_pretrained(folder)
        tokenizer.save_pretrained(folder, save_jinja_files=False)
    (folder / MARKER_FILE).write_text(json.dumps(spec, indent=2, sort_keys=True) + "\n")


@torch.no_grad()
def _draw_routing_biases(model: torch.nn.Module) -> None:
    """DeepSeek-V3's expert-choice correction biases, zero as HF initialises them, drawn wide enough to change
    which experts the (near 0.5) sigmoid scores of random weights choose."""
    for name, tensor in model.state_dict().items():
        if name.endswith("e_score_correction_bias"):
            tensor.normal_(0.0, 0.05)


@torch.no_grad()
def _randomize_biases(model: torch.nn.Module) -> None:
    for name, param in model.named_parameters():
        if name.endswith(".bias"):
            param.normal_(0.0, INIT_STD)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    previous = transformers.logging.get_verbosity()
    had_progress_bars = transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(previous)
        if had_progress_bars:
            transformers.logging.enable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.make_model", description=__doc__)
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny")
    parser.add_argument("--out", type=Path, required=True, help="folder to write the model to")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-weights", action="store_true",
                        help="config and tokenizer only, for load_format dummy (the 8b size is made this way)")
    args = parser.parse_args(argv)
    print(make_model(args.out, args.arch, args.size, args.seed, weights=not args.no_weights))
    return 0


if __name__ == "__main__":
    sys.exit(main())
