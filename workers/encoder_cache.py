"""The vision encoder's outputs by image content hash, least recently used evicted first, within a byte bound."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from ipc.multimodal import ImageInput

# Room for thousands of LLaVA-1.5 images' features at 7B width (576 × 4096 bfloat16 = 4.5 MiB each; a LLaVA-NeXT
# image takes up to five times that).
ENCODER_CACHE_BYTES = 1 << 30


class EncoderCache:
    """Each image is encoded once while its features stay here: a prompt chunked across steps, a preempted request's
    recompute and the same image in another request read them back."""

    def __init__(self, encode: Callable[[torch.Tensor, list], Sequence[torch.Tensor]], device: torch.device,
                 max_bytes: int = ENCODER_CACHE_BYTES) -> None:
        self.encode, self.device, self.max_bytes = encode, device, max_bytes
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_bytes = 0
        self.num_encoded = 0  # images the encoder has run on since start

    def features(self, images: Sequence[ImageInput]) -> dict[str, torch.Tensor]:
        """[features, hidden] of each image by hash; those not cached are encoded together, batched by shape (a tiled
        image's shape counts its tiles), with their original sizes for a tiling model's layout."""
        found = {image.hash: self._take(image.hash) for image in images if image.hash in self.entries}
        missing = {image.hash: image for image in images if image.hash not in found}
        by_shape: dict[tuple[int, ...], list[ImageInput]] = {}
        for image in missing.values():
            by_shape.setdefault(image.shape, []).append(image)
        for batch in by_shape.values():
            pixels = torch.stack([image.tensor() for image in batch]).to(self.device)
            for image, features in zip(batch, self.encode(pixels, [image.image_size for image in batch])):
                found[image.hash] = features.clone()  # its own storage: evicting it frees it
                self._put(image.hash, found[image.hash])
            self.num_encoded += len(batch)
        return found

    def _take(self, image_hash: str) -> torch.Tensor:
        self.entries.move_to_end(image_hash)
        return self.entries[image_hash]

    def _put(self, image_hash: str, features: torch.Tensor) -> None:
        size = features.numel() * features.element_size()
        if size > self.max_bytes:
            return
        while self.num_bytes + size > self.max_bytes:
            _, evicted = self.entries.popitem(last=False)
            self.num_bytes -= evicted.numel() * evicted.element_size()
        self.entries[image_hash] = features
        self.num_bytes += size
