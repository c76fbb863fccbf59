"""A chat's image parts: read from the messages, counted against the per-prompt limit, loaded, handed on."""
from __future__ import annotations

from PIL import Image

from frontend.api.errors import APIError
from frontend.api.media import MediaOptions, load_images, on_media_threads
from frontend.api.protocol import ChatMessage
from frontend.multimodal import ImageProcessor

_DETAILS = ("auto", "low", "high")


def image_urls(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """Every image_url part's (url, param) in the order the conversation gives them; a malformed part: 400."""
    found = []
    for number, message in enumerate(messages):
        if isinstance(message.content, str) or message.content is None:
            continue
        for position, part in enumerate(message.content):
            if part.get("type") == "image_url":
                found.append(_part_url(part, f"messages.{number}.content.{position}.image_url"))
    return found


async def chat_images(messages: list[ChatMessage], options: MediaOptions) -> list[Image.Image]:
    """The conversation's images, checked and decoded (off the event loop); none when it has no image part."""
    urls = image_urls(messages)
    if len(urls) > options.max_images_per_prompt:
        raise APIError(400, f"{len(urls)} images in one prompt, over this server's limit of "
                            f"{options.max_images_per_prompt} (--limit-mm-per-prompt image=N)", "messages")
    return await load_images(urls, options) if urls else []


async def images_for_prompt(images: list[Image.Image], model_name: str, processor: ImageProcessor | None) -> dict:
    """The prompt's multi-modal data ({"multi_modal_data": {"image": [...]}}), processed by the model's image
    processor on the media threads. A model that reads text only refuses images (after they were checked: a bad
    image is told what is wrong with it first)."""
    if processor is None:
        raise APIError(400, f"the model {model_name!r} does not accept images: it reads text only", "messages")
    try:
        processed = await on_media_threads(processor.process, images)
    except ValueError as error:
        raise APIError(400, f"the model's image processor refused an image: {error}", "messages") from None
    return {"multi_modal_data": {"image": processed}}


def _part_url(part: dict, param: str) -> tuple[str, str]:
    image_url = part.get("image_url")
    if not isinstance(image_url, dict) or not isinstance(image_url.get("url"), str):
        raise APIError(400, f"{param}: an image_url part carries {{\"url\": \"...\"}}", param)
    detail = image_url.get("detail", "auto")
    if detail not in _DETAILS:
        raise APIError(400, f"{param}.detail: {detail!r} is not one of {', '.join(_DETAILS)}", f"{param}.detail")
    return image_url["url"], f"{param}.url"
