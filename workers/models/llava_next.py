"""LLaVA-NeXT (1.6): LLaVA-1.5's tower, projector and language model over anyres tiles, an image's features unpadded
to its aspect ratio with a learned newline after each row."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import PretrainedConfig

from ipc.multimodal import ImageTiling
from workers.distributed import parallel_state
from workers.models.llava import LlavaForConditionalGeneration, image_token_id


def image_tiling(config: PretrainedConfig) -> ImageTiling:
    """The config's anyres rule (ValueError for a grid transformers' own model would not cut into whole tiles)."""
    vision = config.vision_config
    tile = vision.image_size
    pinpoints = [tuple(pinpoint) for pinpoint in config.image_grid_pinpoints]
    if any(height % tile or width % tile for height, width in pinpoints):
        raise ValueError(f"LLaVA-NeXT's image_grid_pinpoints must be multiples of the tower's image_size {tile}, "
                         f"got {pinpoints}")
    return ImageTiling(tile, tile // vision.patch_size, pinpoints)


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA-1.5's model with encode_images() over tiles: each image's tiles go through the tower and projector
    together, the base view's features first, then the grid's, unpadded, each row ended by image_newline."""

    checkpoint_prefixes = {"model.image_newline": "image_newline", **LlavaForConditionalGeneration.checkpoint_prefixes}

    def __init__(self, config: PretrainedConfig) -> None:
        if config.vision_feature_select_strategy != "default":
            # The grid's features are patches × patches per tile: a class token kept in each has no place in it
            # (transformers' own LLaVA-NeXT cannot lay them out either).
            raise ValueError("LLaVA-NeXT with a CLIP tower takes vision_feature_select_strategy 'default', got "
                             f"{config.vision_feature_select_strategy!r}")
        super().__init__(config)
        self.tiling = image_tiling(config)
        self.image_newline = nn.Parameter(torch.empty(config.get_text_config().hidden_size)) \
            if parallel_state().is_first_stage else None

    @staticmethod
    def image_inputs(config: PretrainedConfig) -> dict:
        return {"image_token_id": image_token_id(config), "image_tiling": image_tiling(config)}

    @torch.no_grad()
    def encode_images(self, pixel_values: torch.Tensor, image_sizes: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """[images, tiles, channels, height, width] and each image's original (height, width) → each image's
        [features, hidden]: the rows its placeholders take."""
        images, tiles = pixel_values.shape[:2]
        features = super().encode_images(pixel_values.flatten(0, 1)).unflatten(0, (images, tiles))
        return [self._pack(image, size) for image, size in zip(features, image_sizes)]

    def _pack(self, features: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
        """One image's [tiles, patches², hidden] → its features in placeholder order."""
        patches, (rows, cols) = self.tiling.patches, self.tiling.grid(*image_size)
        grid = features[1:].unflatten(0, (rows, cols)).unflatten(2, (patches, patches))
        # [rows, cols, patch rows, patch cols, hidden] → one feature map [rows × patch rows, cols × patch cols, hidden]
        grid = grid.permute(0, 2, 1, 3, 4).flatten(2, 3).flatten(0, 1)
        kept_rows, kept_cols = self.tiling.unpadded(*image_size)
        grid = grid[kept_rows, kept_cols]
        newlines = self.image_newline.to(grid.dtype).expand(grid.shape[0], 1, -1)
        return torch.cat([features[0], torch.cat([grid, newlines], dim=1).flatten(0, 1)])
