"""The vision encoder's share of a step (vLLM's encoder budget): a prompt chunk stops before an image whose encoding
would not fit what the step has left."""
from __future__ import annotations

from core.request import Request


def chunk_within_encoder_budget(request: Request, start: int, num_new: int, budget: int, untouched: bool
                                ) -> tuple[int, int]:
    """(how many of the `num_new` tokens from `start` the step may take, encoder tokens they spend). An image is
    paid for by the first chunk that reaches its placeholders (its features are then in the worker's encoder cache
    for the later chunks), at its feature count, vLLM's measure of the encoder's work. The chunk ends before an
    image that would overspend `budget` (the encoder tokens the step has left), unless it is the step's first
    encoder work (`untouched`): an image larger than the whole budget still runs, alone."""
    images = request.mm_inputs
    if not images or request.num_encoded_images == len(images):
        return num_new, 0
    end, spent = start + num_new, 0
    for image in images[request.num_encoded_images:]:
        if image.offset >= end:
            break
        if image.end <= start:  # every placeholder of it was found in the prefix cache: nothing to encode
            continue
        if spent + image.length > budget and not (untouched and spent == 0):
            return max(image.offset - start, 0), spent
        spent += image.length
    return num_new, spent


def count_encoded(request: Request) -> None:
    """After a chunk is committed: its images up to the computed tokens are paid for."""
    images = request.mm_inputs or ()
    while request.num_encoded_images < len(images) and \
            images[request.num_encoded_images].offset < request.num_computed_tokens:
        request.num_encoded_images += 1
