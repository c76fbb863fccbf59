"""LoRARequest: the adapter a request runs with (vLLM's shape: a name, a positive integer id, a PEFT folder)."""
from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from ipc.bounds import MAX_ID_LENGTH

MAX_PATH_LENGTH = 4096


class LoRARequest(msgspec.Struct, frozen=True):
    """One adapter: requests with the same lora_int_id share its loaded weights and its prefix-cache blocks."""

    lora_name: Annotated[str, Meta(min_length=1, max_length=MAX_ID_LENGTH)]
    lora_int_id: Annotated[int, Meta(ge=1, le=2**31 - 1)]
    lora_path: Annotated[str, Meta(min_length=1, max_length=MAX_PATH_LENGTH)]

    @property
    def cache_key(self) -> str:
        """What keys its prefix-cache blocks apart from the base model's and every other adapter's."""
        return f"lora:{self.lora_int_id}:{self.lora_name}"
