"""The engine core's check of a request's adapter before it is queued: a bad adapter is that request's error (HTTP
400 with the reason), never a worker's failure."""
from __future__ import annotations

from collections import OrderedDict

import torch
from transformers import PretrainedConfig

from ipc import LoRARequest
from workers.distributed import single_rank
from workers.lora.adapter import load_adapter
from workers.lora.files import check_under
from workers.lora.targets import check_adapter
from workers.models import get_model_class

KNOWN_ADAPTERS = 1024  # validated adapters remembered (a request naming one again is not re-read)


class AdapterValidator:
    def __init__(self, hf_config: PretrainedConfig, max_rank: int, allowed_dirs: list[str] | None) -> None:
        self.hf_config, self.max_rank, self.allowed_dirs = hf_config, max_rank, allowed_dirs
        self.known: OrderedDict[int, LoRARequest] = OrderedDict()
        self._model: torch.nn.Module | None = None

    def check(self, lora: LoRARequest) -> None:
        """ValueError naming what is wrong: an unreadable or corrupt folder, DoRA, a rank over max_lora_rank,
        modules this model lacks, or an id already naming another adapter."""
        known = self.known.get(lora.lora_int_id)
        if known == lora:
            self.known.move_to_end(lora.lora_int_id)
            return
        if known is not None:
            raise ValueError(f"lora_int_id {lora.lora_int_id} already names adapter {known.lora_name!r} at "
                             f"{known.lora_path!r}; give this one another id")
        check_under(lora.lora_path, self.allowed_dirs)
        adapter = load_adapter(lora.lora_name, lora.lora_int_id, lora.lora_path, self.max_rank)
        check_adapter(self.model, adapter, lora.lora_path, self.hf_config.vocab_size, self.hf_config.hidden_size)
        self.known[lora.lora_int_id] = lora
        while len(self.known) > KNOWN_ADAPTERS:
            self.known.popitem(last=False)

    @property
    def model(self) -> torch.nn.Module:
        """The whole model's structure on the meta device (no memory): what adapters are checked against."""
        if self._model is None:
            with torch.device("meta"), single_rank():
                self._model = get_model_class(self.hf_config)(self.hf_config)
        return self._model
