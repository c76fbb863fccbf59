"""How a model folder pools: sentence-transformers' modules (Pooling, Normalize, max_seq_length) when it has them,
else the architecture's default; overridden by the engine's pooler_config."""
from __future__ import annotations

import json
from pathlib import Path

from transformers import PretrainedConfig

from ipc import PoolerConfig, PoolingInfo

ENCODER_ARCHITECTURES = frozenset({"BertModel", "BertForSequenceClassification"})
CLASSIFIER_ARCHITECTURES = frozenset({"BertForSequenceClassification"})
# Decoders saved without their LM head (embedding models such as E5-Mistral): they pool, they cannot generate.
BASE_MODEL_ARCHITECTURES = frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"})
_ST_POOLING_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN",
                     "pooling_mode_lasttoken": "LAST"}
_ST_MODULES = ("sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
               "sentence_transformers.models.Normalize")


def is_encoder(config: PretrainedConfig) -> bool:
    return bool(ENCODER_ARCHITECTURES & set(config.architectures or ()))


def pooling_info(model_dir: str, config: PretrainedConfig, overrides: PoolerConfig | None) -> PoolingInfo:
    """The model's pooling: ValueError for a sentence-transformers pipeline this engine does not compute."""
    classifier = bool(CLASSIFIER_ARCHITECTURES & set(config.architectures or ()))
    pooling_type, normalize = ("CLS", False) if classifier else _sentence_transformers_pooling(Path(model_dir)) \
        or ("CLS" if is_encoder(config) else "LAST", True)
    if overrides is not None:
        pooling_type = overrides.pooling_type or pooling_type
        normalize = normalize if overrides.normalize is None else overrides.normalize
    labels = [str(config.id2label[i]) for i in range(config.num_labels)] if classifier else []
    headless = bool(BASE_MODEL_ARCHITECTURES & set(config.architectures or ()))
    return PoolingInfo(pooling_type=pooling_type, normalize=normalize, hidden_size=config.get_text_config().hidden_size,
                       num_labels=len(labels), labels=labels,
                       matryoshka=bool(getattr(config, "matryoshka_dimensions", None)
                                       or getattr(config, "is_matryoshka", False)),
                       generates=not (is_encoder(config) or headless),
                       type_vocab_size=getattr(config, "type_vocab_size", 0) if is_encoder(config) else 0)


def max_seq_length(model_dir: str) -> int | None:
    """sentence-transformers' max_seq_length (it truncates there), if the folder has one."""
    path = Path(model_dir) / "sentence_bert_config.json"
    return json.loads(path.read_text()).get("max_seq_length") if path.is_file() else None


def _sentence_transformers_pooling(folder: Path) -> tuple[str, bool] | None:
    """(pooling type, normalize) of a sentence-transformers folder (modules.json), None for another folder."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = json.loads(modules_file.read_text())
    unsupported = [m["type"] for m in modules if m["type"] not in _ST_MODULES]
    if unsupported:
        raise ValueError(f"the sentence-transformers modules {unsupported} are not supported; supported: "
                         f"{list(_ST_MODULES)}")
    pooling_type = "CLS"
    for module in modules:
        if module["type"].endswith(".Pooling"):
            settings = json.loads((folder / module["path"] / "config.json").read_text())
            modes = [mode for key, mode in _ST_POOLING_MODES.items() if settings.get(key)]
            others = [key for key, on in settings.items() if key.startswith("pooling_mode") and on
                      and key not in _ST_POOLING_MODES]
            if len(modes) != 1 or others:
                raise ValueError(f"sentence-transformers pooling {settings} is not supported: exactly one of "
                                 f"{sorted(_ST_POOLING_MODES)}")
            pooling_type = modes[0]
    return pooling_type, any(m["type"].endswith(".Normalize") for m in modules)
