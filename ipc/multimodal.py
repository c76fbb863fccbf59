"""A processed image as it crosses to the engine: pixel values as raw bytes, its content hash and its placeholders."""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Annotated

import msgspec
from msgspec import Meta

from ipc.bounds import MAX_PROMPT_TOKENS, Count
from ipc.prompt_embeds import ITEM_SIZES, EmbedsDtype, bytes_tensor, tensor_bytes

if TYPE_CHECKING:
    import torch

MAX_IMAGES_PER_PROMPT = 64
MAX_IMAGE_SIDE = 4096  # of the processed pixel values (the processor resizes every image to the tower's size)
Side = Annotated[int, Meta(ge=1, le=MAX_IMAGE_SIDE)]


class ImageInput(msgspec.Struct, frozen=True):
    """One image of a prompt: its [channels, height, width] pixel values in `dtype` (this machine's byte order), their
    content_hash() (the encoder cache's and the prefix cache's key, checked by the engine: a client cannot put its
    features under another image's key), and the `length` placeholder tokens from prompt position `offset` whose
    embeddings its features replace."""

    data: bytes
    dtype: EmbedsDtype
    shape: tuple[Annotated[int, Meta(ge=1, le=4)], Side, Side]
    hash: Annotated[str, Meta(pattern="^[0-9a-f]{64}$")]
    offset: Count
    length: Annotated[int, Meta(ge=1, le=MAX_PROMPT_TOKENS)]

    def __post_init__(self) -> None:
        expected = self.shape[0] * self.shape[1] * self.shape[2] * ITEM_SIZES[self.dtype]
        if len(self.data) != expected:
            raise ValueError(f"an image's pixel values of shape {list(self.shape)} in {self.dtype} take {expected} "
                             f"bytes, got {len(self.data)}")

    @property
    def end(self) -> int:
        """The prompt position after its last placeholder."""
        return self.offset + self.length

    @classmethod
    def of(cls, pixel_values: torch.Tensor, offset: int, length: int) -> ImageInput:
        data, dtype, shape = tensor_bytes(pixel_values), str(pixel_values.dtype).removeprefix("torch."), \
            tuple(pixel_values.shape)
        return cls(data, dtype, shape, content_hash(data, dtype, shape), offset, length)

    def content_hash(self) -> str:
        return content_hash(self.data, self.dtype, self.shape)

    def tensor(self) -> torch.Tensor:
        """The pixel values as a CPU tensor of `dtype` (a copy: the bytes stay immutable)."""
        return bytes_tensor(self.data, self.dtype, self.shape)


def content_hash(data: bytes, dtype: str, shape: tuple[int, ...]) -> str:
    """sha256 of pixel values with their dtype and shape."""
    digest = hashlib.sha256(f"{dtype}:{list(shape)}:".encode())
    digest.update(data)
    return digest.hexdigest()
