"""A model's recommended sampling defaults from its generation_config.json (vLLM's `--generation-config`)."""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from ipc.sampling_params import SamplingParams

logger = logging.getLogger("pagedserve.generation_config")
FILE_NAME = "generation_config.json"
# generation_config.json key → SamplingParams field; the keys vLLM's get_diff_sampling_param takes. do_sample is not
# among them: vLLM applies these whatever it says, and so do we.
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def load_generation_defaults(model_dir: str, mode: str = "auto") -> dict[str, float | int]:
    """The SamplingParams defaults `mode` gives: "vllm" none, "auto" the model folder's generation_config.json
    (none, with a warning, if it is missing or unreadable), any other value the generation_config.json in that
    folder (ValueError if it cannot be read: the operator named it)."""
    if mode == "vllm":
        return {}
    folder = Path(model_dir if mode == "auto" else mode)
    try:
        config = _read(folder / FILE_NAME)
    except ValueError as error:
        if mode != "auto":
            raise ValueError(f"--generation-config {mode}: {error}") from None
        if (folder / FILE_NAME).exists():
            logger.warning("%s; no model sampling defaults apply", error)
        return {}
    defaults = {}
    for key, field in _KEYS.items():
        value = config.get(key)
        if value is None:
            continue
        try:
            defaults[field] = _converted(field, value)
        except ValueError as error:
            logger.warning("%s: ignoring %s=%r: %s", folder / FILE_NAME, key, value, error)
    if defaults:
        logger.info("sampling defaults from %s for requests that leave them out: %s (--generation-config vllm "
                    "turns them off)", folder / FILE_NAME, defaults)
    return defaults


def model_stop_token_ids(model_dir: str, tokenizer_eos: int | None) -> list[int]:
    """The end-of-sequence ids of the model's generation_config.json besides the tokenizer's EOS (a chat model's
    end-of-turn token): vLLM adds them to every request's stop_token_ids, and so do we; none without a readable
    file. They apply whatever --generation-config says: they say where the model stops, not how it samples."""
    try:
        eos = _read(Path(model_dir) / FILE_NAME).get("eos_token_id")
    except ValueError:
        return []
    ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    return [i for i in dict.fromkeys(ids) if isinstance(i, int) and not isinstance(i, bool) and i >= 0
            and i != tokenizer_eos]


def with_stop_token_ids(params: SamplingParams, ids: list[int]) -> SamplingParams:
    """`params` stopping at `ids` too (as at EOS: not with ignore_eos)."""
    if not ids or params.ignore_eos:
        return params
    own = params.stop_token_ids or []
    return msgspec.structs.replace(params, stop_token_ids=own + [i for i in ids if i not in own])


def apply_generation_defaults(fields: Mapping[str, Any], defaults: Mapping[str, float | int]) -> dict[str, Any]:
    """`fields` (SamplingParams keywords, None where the request left a field out) with `defaults` in those gaps."""
    return {**fields, **{name: value for name, value in defaults.items() if fields.get(name) is None}}


def _read(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} cannot be read as JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} is not a JSON object")
    return config


def _converted(field: str, value: Any) -> float | int:
    """`value` as the default of SamplingParams' `field`; ValueError if it cannot be one."""
    integral = field in ("top_k", "max_tokens")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("not a number")
    if integral and not float(value).is_integer():
        raise ValueError("not an integer")
    converted = int(value) if integral else float(value)
    SamplingParams(**{field: converted})  # its bounds: ValueError naming the field
    return converted
