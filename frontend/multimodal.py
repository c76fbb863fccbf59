"""Images of a prompt, processed in the front end: the checkpoint's own image processor (its results kept by content
hash), each <image> placeholder expanded to that image's feature count."""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any

import msgspec

from ipc import EngineInfo
from ipc.multimodal import MAX_IMAGES_PER_PROMPT, ImageInput

# Processed images kept for reuse (LLaVA-1.5's 336 × 336 float32 pixels: 1.3 MiB an image; LLaVA-NeXT's up to 5 tiles).
PROCESSED_CACHE_BYTES = 256 << 20
_ACCEPTED = ("{'prompt': text (or 'prompt_token_ids': ids) with one <image> placeholder per image, "
             "'multi_modal_data': {'image': PIL.Image or [images]}}")


def image_hash(image: Any) -> str:
    """sha256 of an image's mode, size and pixels: the same picture from any source is the same key."""
    digest = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def images_of(prompt: Any) -> list | None:
    """A dict prompt's multi_modal_data images as a list (None without any): PIL images, or images the model's
    ImageProcessor.process() made of them (the gateway processes off its event loop); ValueError for other media or
    objects."""
    if not isinstance(prompt, dict) or prompt.get("multi_modal_data") is None:
        return None
    data = prompt["multi_modal_data"]
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError(f"multi_modal_data must be {{'image': PIL.Image or [images]}}, got "
                         f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
    from PIL import Image

    images = data.get("image")
    images = [images] if isinstance(images, Image.Image) else images
    if not isinstance(images, (list, tuple)) or \
            not all(isinstance(image, (Image.Image, ImageInput)) for image in images):
        kinds = sorted({type(image).__name__ for image in images}) if isinstance(images, (list, tuple)) else \
            [type(images).__name__]
        raise ValueError(f"multi_modal_data['image'] must be a PIL.Image or a list of them, got {', '.join(kinds)}")
    if len(images) > MAX_IMAGES_PER_PROMPT:
        raise ValueError(f"a prompt takes at most {MAX_IMAGES_PER_PROMPT} images, got {len(images)}")
    return list(images)


def chat_image_parts(messages: list[dict]) -> tuple[list[dict], list]:
    """The conversation with each image part ({"type": "image_pil", "image_pil": PIL.Image} or an image_url part with a
    data: URL) as {"type": "image"}, which chat templates write as the model's placeholder, and its images in order
    (ValueError naming a part that holds no image)."""
    images, rendered = [], []
    for number, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            rendered.append(message)
            continue
        parts = []
        for position, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("image_pil", "image_url"):
                images.append(_part_image(part, kind, f"messages.{number}.content.{position}"))
                part = {"type": "image"}
            parts.append(part)
        rendered.append({**message, "content": parts})
    return rendered, images


def _part_image(part: dict, kind: str, where: str) -> Any:
    from PIL import Image

    if kind == "image_pil":
        if not isinstance(part.get("image_pil"), Image.Image):
            raise ValueError(f"{where}.image_pil must be a PIL.Image")
        return part["image_pil"]
    from frontend.api.errors import APIError
    from frontend.api.media import MediaOptions, load_image

    url = (part.get("image_url") or {}).get("url") if isinstance(part.get("image_url"), dict) else None
    if not isinstance(url, str) or not url.startswith("data:"):
        raise ValueError(f"{where}.image_url.url must be a data: URL here (LLM.chat loads no files or remote URLs; "
                         "open them yourself and give {'type': 'image_pil', 'image_pil': image})")
    try:
        return load_image(url, MediaOptions(), f"{where}.image_url")
    except APIError as error:
        raise ValueError(error.message) from None


class ImageProcessor:
    """A vision-language model's image processor (transformers', from its folder) and its placeholder rule."""

    def __init__(self, model_folder: str, info: EngineInfo) -> None:
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(model_folder)
        self.image_token_id: int = info.image_token_id
        self.feature_count, self.tiling = info.image_feature_count, info.image_tiling
        # Processed images by hash, least recently used first: the same image again skips the processor.
        self.processed: OrderedDict[str, ImageInput] = OrderedDict()
        self.processed_bytes = 0
        self.num_processed = 0  # images the processor has run on
        self.lock = threading.Lock()  # the cache, for the gateway's processing threads

    @classmethod
    def of(cls, model_folder: str, info: EngineInfo) -> ImageProcessor | None:
        """The model's processor, or None for a model that takes no images."""
        return cls(model_folder, info) if info.image_token_id is not None else None

    def expand(self, token_ids: list[int], images: list) -> tuple[list[int], list[ImageInput]]:
        """The prompt's ids with each placeholder repeated to its image's feature count, and the images as the engine
        takes them (ValueError when placeholders and images do not pair up)."""
        at = [i for i, token in enumerate(token_ids) if token == self.image_token_id]
        if len(at) != len(images):
            raise ValueError(f"the prompt has {len(at)} image placeholder(s) but {len(images)} image(s) were given: "
                             f"write one placeholder token per image where it goes ({_ACCEPTED})")
        processed = [image if isinstance(image, ImageInput) else None for image in images]
        if None in processed:
            processed = self.process(images)
        expanded, inputs, done = [], [], 0
        for position, image in zip(at, processed):
            expanded += token_ids[done:position]
            inputs.append(msgspec.structs.replace(image, offset=len(expanded)))
            expanded += [self.image_token_id] * image.length
            done = position + 1
        return expanded + token_ids[done:], inputs

    def process(self, images: list) -> list[ImageInput]:
        """Each image processed (placeholders at 0; processed ones as they are), from the cache where it was
        processed before. Safe from several threads at once."""
        # PIL images by their pixels' hash (before processing); processed ones by theirs.
        hashes = [image.hash if isinstance(image, ImageInput) else image_hash(image) for image in images]
        with self.lock:
            found = {digest: self.processed[digest] for digest in hashes if digest in self.processed}
            for digest in found:
                self.processed.move_to_end(digest)
        found |= {image.hash: image for image in images if isinstance(image, ImageInput)}
        new = {digest: image for digest, image in zip(hashes, images) if digest not in found}
        if new:
            processed = [self._input(image.convert("RGB")) for image in new.values()]
            with self.lock:
                self.num_processed += len(new)
                for digest, image in zip(new, processed):
                    found[digest] = image
                    self._keep(digest, image)
        return [found[digest] for digest in hashes]

    def _input(self, image: Any) -> ImageInput:
        """One image through the processor: one view, or (a tiling model) its tiles, the base view first, and its
        original size, which gives its feature count."""
        processed = self.processor([image], return_tensors="pt")
        if self.tiling is None:
            return ImageInput.of(processed["pixel_values"][0], 0, self.feature_count)
        size = tuple(int(side) for side in processed["image_sizes"][0])
        return ImageInput.of(processed["pixel_values"][0], 0, self.tiling.feature_count(*size), size)

    def _keep(self, digest: str, image: ImageInput) -> None:
        self.processed[digest] = image
        self.processed_bytes += len(image.data)
        while self.processed_bytes > PROCESSED_CACHE_BYTES:
            _, dropped = self.processed.popitem(last=False)
            self.processed_bytes -= len(dropped.data)


def check_image_prompt(prompt: dict, processor: ImageProcessor | None) -> None:
    """ValueError unless images come with a text prompt to a model that takes them."""
    if processor is None:
        raise ValueError("this model takes no images (it is a text-only model); drop multi_modal_data")
    if "prompt_embeds" in prompt:
        raise ValueError(f"images go with a text prompt or token ids, not prompt_embeds: give {_ACCEPTED}")
