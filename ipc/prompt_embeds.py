"""A prompt given as embeddings instead of token ids: raw bytes, dtype and shape, never a pickle."""
from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

import msgspec
from msgspec import Meta

from ipc.bounds import MAX_PROMPT_TOKENS

if TYPE_CHECKING:
    import torch

EmbedsDtype = Literal["float32", "float16", "bfloat16"]
ITEM_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2}
MAX_HIDDEN_SIZE = 2**20


class PromptEmbeds(msgspec.Struct, frozen=True):
    """One prompt's [rows, hidden_size] embeddings, in place of its tokens' rows of the model's input embedding:
    `data` holds them row by row in `dtype` (this machine's byte order, as every tensor frame of ours)."""

    data: bytes
    dtype: EmbedsDtype
    shape: tuple[Annotated[int, Meta(ge=1, le=MAX_PROMPT_TOKENS)], Annotated[int, Meta(ge=1, le=MAX_HIDDEN_SIZE)]]

    def __post_init__(self) -> None:
        expected = self.shape[0] * self.shape[1] * ITEM_SIZES[self.dtype]
        if len(self.data) != expected:
            raise ValueError(f"prompt_embeds of shape {list(self.shape)} in {self.dtype} take {expected} bytes, "
                             f"got {len(self.data)}")

    @property
    def num_rows(self) -> int:
        return self.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.shape[1]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> PromptEmbeds:
        """A 2-D floating tensor's rows (ValueError naming prompt_embeds for any other)."""
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"prompt_embeds must be a torch.Tensor, got {type(tensor).__name__}")
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in ITEM_SIZES or tensor.dim() != 2 or 0 in tensor.shape:
            raise ValueError(f"prompt_embeds must be a non-empty 2-D [seq_len, hidden_size] tensor of "
                             f"{'/'.join(ITEM_SIZES)}, got shape {list(tensor.shape)} of {dtype}")
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError("prompt_embeds holds NaN or infinite values")
        return cls(tensor_bytes(tensor), dtype, tuple(tensor.shape))

    def tensor(self) -> torch.Tensor:
        """The embeddings as a CPU tensor of `dtype` (a copy: the bytes stay immutable)."""
        return bytes_tensor(self.data, self.dtype, self.shape)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's values as raw bytes, row-major, in its dtype (this machine's byte order)."""
    import torch

    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def bytes_tensor(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """tensor_bytes() read back: a CPU tensor of `dtype` and `shape` (a copy: the bytes stay immutable)."""
    import torch

    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)
