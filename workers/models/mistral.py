"""Mistral: the llama decoder with sliding-window attention (the window comes from the config)."""
from __future__ import annotations

from workers.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Identical layers to llama; `sliding_window_of` reads mistral's single window for every layer."""
