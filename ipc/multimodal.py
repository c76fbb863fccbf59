"""A processed image as it crosses to the engine (pixel values as raw bytes, its content hash and its placeholders),
and the rule of a tiling model's features per image."""
from __future__ import annotations

import hashlib
import math
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
OriginalSide = Annotated[int, Meta(ge=1, le=1 << 30)]  # of the image as given (media loading bounds its pixels)


class ImageInput(msgspec.Struct, frozen=True):
    """One image of a prompt: its [channels, height, width] pixel values in `dtype` (this machine's byte order), or
    [tiles, channels, height, width] with the image's original (height, width) `image_size` for a tiling model, their
    content_hash() (the encoder cache's and the prefix cache's key, checked by the engine: a client cannot put its
    features under another image's key), and the `length` placeholder tokens from prompt position `offset` whose
    embeddings its features replace."""

    data: bytes
    dtype: EmbedsDtype
    shape: Annotated[tuple[Side, ...], Meta(min_length=3, max_length=4)]
    hash: Annotated[str, Meta(pattern="^[0-9a-f]{64}$")]
    offset: Count
    length: Annotated[int, Meta(ge=1, le=MAX_PROMPT_TOKENS)]
    image_size: tuple[OriginalSide, OriginalSide] | None = None

    def __post_init__(self) -> None:
        if self.shape[-3] > 4:
            raise ValueError(f"an image's pixel values have at most 4 channels, got shape {list(self.shape)}")
        if (len(self.shape) == 4) != (self.image_size is not None):
            raise ValueError("tiled pixel values [tiles, channels, height, width] come with the image's original "
                             f"(height, width) image_size, and only they: got shape {list(self.shape)}, image_size "
                             f"{self.image_size}")
        expected = math.prod(self.shape) * ITEM_SIZES[self.dtype]
        if len(self.data) != expected:
            raise ValueError(f"an image's pixel values of shape {list(self.shape)} in {self.dtype} take {expected} "
                             f"bytes, got {len(self.data)}")

    @property
    def end(self) -> int:
        """The prompt position after its last placeholder."""
        return self.offset + self.length

    @classmethod
    def of(cls, pixel_values: torch.Tensor, offset: int, length: int,
           image_size: tuple[int, int] | None = None) -> ImageInput:
        data, dtype, shape = tensor_bytes(pixel_values), str(pixel_values.dtype).removeprefix("torch."), \
            tuple(pixel_values.shape)
        return cls(data, dtype, shape, content_hash(data, dtype, shape, image_size), offset, length, image_size)

    def content_hash(self) -> str:
        return content_hash(self.data, self.dtype, self.shape, self.image_size)

    def tensor(self) -> torch.Tensor:
        """The pixel values as a CPU tensor of `dtype` (a copy: the bytes stay immutable)."""
        return bytes_tensor(self.data, self.dtype, self.shape)


def content_hash(data: bytes, dtype: str, shape: tuple[int, ...], image_size: tuple[int, int] | None = None) -> str:
    """sha256 of pixel values with their dtype and shape (and a tiled image's original size)."""
    size = "" if image_size is None else f"{list(image_size)}:"
    digest = hashlib.sha256(f"{dtype}:{list(shape)}:{size}".encode())
    digest.update(data)
    return digest.hexdigest()


class ImageTiling(msgspec.Struct, frozen=True):
    """LLaVA-NeXT's anyres rule: an image is resized into the grid pinpoint that fits it best, cut into square tiles
    of `tile_size` pixels (`patches` × `patches` features each) after a base view of the whole image; the grid's
    features are unpadded back to the image's aspect ratio, with a newline feature after each row."""

    tile_size: Annotated[int, Meta(ge=1, le=MAX_IMAGE_SIDE)]
    patches: Annotated[int, Meta(ge=1, le=MAX_IMAGE_SIDE)]
    grid_pinpoints: Annotated[list[tuple[Side, Side]], Meta(min_length=1, max_length=256)]  # (height, width)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """Tile rows and columns for an image of this original size (transformers' choice of pinpoint)."""
        from transformers.image_processing_utils import select_best_resolution

        best_height, best_width = select_best_resolution((height, width), self.grid_pinpoints)
        return best_height // self.tile_size, best_width // self.tile_size

    def num_tiles(self, height: int, width: int) -> int:
        """The base view and the grid's tiles."""
        rows, cols = self.grid(height, width)
        return 1 + rows * cols

    def unpadded(self, height: int, width: int) -> tuple[slice, slice]:
        """The rows and columns of the grid's feature map (tiles × patches a side) that the image covers: the
        resized image sits centred in the pinpoint, and the padding's features are dropped."""
        rows, cols = self.grid(height, width)
        grid_height, grid_width = rows * self.patches, cols * self.patches
        # transformers' arithmetic, float for float: a count off by one would misplace every later feature.
        if width / height > grid_width / grid_height:
            kept = int(round(height * (grid_width / width), 7))
            pad = (grid_height - kept) // 2
            return slice(pad, grid_height - pad), slice(0, grid_width)
        kept = int(round(width * (grid_height / height), 7))
        pad = (grid_width - kept) // 2
        return slice(0, grid_height), slice(pad, grid_width - pad)

    def feature_count(self, height: int, width: int) -> int:
        """Placeholders of an image of this original size: the base view's patches, then each kept grid row's
        features and its newline."""
        rows, cols = self.unpadded(height, width)
        kept_rows, kept_cols = rows.stop - rows.start, cols.stop - cols.start
        return self.patches ** 2 + kept_rows * (kept_cols + 1)
