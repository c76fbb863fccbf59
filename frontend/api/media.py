"""An image content part's URL (data:, file:// under the allowed folder, http(s) when allowed) → a checked PIL image."""
from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import stat
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlparse

import httpx
from PIL import Image

from frontend.api.errors import APIError

# Pixels (width x height, read from the header before any decoding): 8,000 x 6,000 passes; a decompression bomb, whose
# few kilobytes claim gigapixels, is refused before a byte of it is decompressed.
MAX_IMAGE_PIXELS = 48_000_000
DEFAULT_MAX_IMAGE_BYTES = 20 * 2**20
DEFAULT_FETCH_TIMEOUT_S = 10.0
SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_SIGNATURES = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"),
               (b"BM", "BMP"))
# Decoding holds the GIL only in part, but each image in flight holds its pixels: a few at a time per gateway.
_DECODERS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="media")
T = TypeVar("T")


@dataclass(frozen=True)
class MediaOptions:
    """Where images may come from and how big they may be (the gateway's --allowed-local-media-path,
    --allow-remote-media, --max-image-bytes, --media-fetch-timeout and --limit-mm-per-prompt)."""
    allowed_local_path: Path | None = None  # resolved; None: file:// URLs are refused
    allow_remote: bool = False
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    max_images_per_prompt: int = 4


async def load_images(urls: Sequence[tuple[str, str]], options: MediaOptions) -> list[Image.Image]:
    """(url, param) pairs → their images, read and decoded on the media threads (never on the event loop)."""
    return list(await asyncio.gather(*(on_media_threads(load_image, url, options, param) for url, param in urls)))


async def on_media_threads(work: Callable[..., T], *args: Any) -> T:
    """work(*args) on the media threads: image work never runs on the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_DECODERS, work, *args)


def load_image(url: str, options: MediaOptions, param: str = "image_url") -> Image.Image:
    """The image at `url`, decoded (a GIF's first frame) and converted to RGB; APIError(400) naming the cause."""
    return decode_image(image_bytes(url, options, param), options.max_image_bytes, param)


def image_bytes(url: str, options: MediaOptions, param: str = "image_url") -> bytes:
    """The encoded image `url` names, at most options.max_image_bytes."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, options.max_image_bytes, param)
    if scheme == "file":
        return _local_file(url, options, param)
    if scheme in ("http", "https"):
        if not options.allow_remote:
            raise APIError(400, "image URLs over http(s) are not fetched by this server (it runs without "
                                "--allow-remote-media): send the image as a data: URL", param)
        return _remote(url, options, param)
    raise APIError(400, f"image URL scheme {scheme or url[:20]!r} is not supported: use a data: URL (data:image/png;"
                        "base64,...), a file:// URL or an http(s) URL", param)


def decode_image(data: bytes, max_bytes: int, param: str = "image_url") -> Image.Image:
    """`data` decoded; a size, format or pixel count over the limits, or a corrupt or truncated file: APIError(400)."""
    if len(data) > max_bytes:
        raise _too_large(len(data), max_bytes, param)
    kind = image_format(data)
    if kind is None:
        raise APIError(400, f"unsupported image format: the data is none of {', '.join(SUPPORTED_FORMATS)}", param)
    try:
        with Image.open(io.BytesIO(data), formats=[kind]) as image:
            pixels = image.width * image.height
            if pixels > MAX_IMAGE_PIXELS:
                raise _bomb(f"{image.width} x {image.height} = {pixels:,} pixels", param)
            image.seek(0)
            return image.convert("RGB")
    except Image.DecompressionBombError:  # PIL's own check in open(), past twice its limit: ours is lower
        raise _bomb(f"its header claims over {2 * (Image.MAX_IMAGE_PIXELS or 0):,} pixels", param) from None
    except Image.UnidentifiedImageError:  # its message names a BytesIO object, of no use to the client
        raise APIError(400, f"corrupt {kind} image: its header cannot be read", param) from None
    except (OSError, SyntaxError, ValueError, EOFError) as error:
        raise APIError(400, f"corrupt or truncated {kind} image: {error}", param) from None


def image_format(data: bytes) -> str | None:
    """The supported format `data` starts as (its signature), or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return next((kind for signature, kind in _SIGNATURES if data.startswith(signature)), None)


def _bomb(size: str, param: str) -> APIError:
    return APIError(400, f"image too large: {size}, over this server's limit of {MAX_IMAGE_PIXELS:,} pixels "
                         "(a decompression bomb?)", param)


def _too_large(size: int | str, max_bytes: int, param: str) -> APIError:
    return APIError(400, f"image too large: {size} bytes encoded, over this server's limit of {max_bytes} "
                         "(--max-image-bytes)", param)


def _data_url(url: str, max_bytes: int, param: str) -> bytes:
    header, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise APIError(400, "malformed data: URL (no comma before the data)", param)
    media_type, *parameters = header.split(";")
    if not parameters or parameters[-1].strip().lower() != "base64":
        raise APIError(400, "data: URL is not base64: an image is sent as data:image/<format>;base64,<data>", param)
    if media_type and not media_type.strip().lower().startswith("image/"):
        raise APIError(400, f"data: URL media type {media_type!r} is not an image type (image/...)", param)
    if len(payload) // 4 * 3 > max_bytes:  # checked before decoding it
        raise _too_large(f"about {len(payload) // 4 * 3}", max_bytes, param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise APIError(400, f"data: URL is not valid base64: {error}", param) from None


def _local_file(url: str, options: MediaOptions, param: str) -> bytes:
    root = options.allowed_local_path
    if root is None:
        raise APIError(400, "file:// image URLs are refused: this server runs without --allowed-local-media-path",
                       param)
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise APIError(400, f"file:// URL names host {parsed.netloc!r}: only local files are read", param)
    if "\0" in (path_text := unquote(parsed.path)):
        raise APIError(400, "file:// URL holds a NUL byte", param)
    path = Path(path_text).resolve()  # symlinks and ".." resolved before the check
    if not path.is_relative_to(root):
        raise APIError(400, "file:// URL is outside the folder this server reads images from "
                            "(--allowed-local-media-path)", param)
    try:  # O_NONBLOCK: a FIFO does not hang the thread; O_NOFOLLOW: no symlink swapped in since the check
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as error:
        raise APIError(400, f"file:// URL cannot be read: {error.strerror}", param) from None
    with os.fdopen(descriptor, "rb") as file:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise APIError(400, "file:// URL does not name a regular file", param)
        if info.st_size > options.max_image_bytes:
            raise _too_large(info.st_size, options.max_image_bytes, param)
        return file.read(options.max_image_bytes + 1)


def _remote(url: str, options: MediaOptions, param: str) -> bytes:
    limit, deadline = options.max_image_bytes, time.monotonic() + options.fetch_timeout_s
    try:
        with httpx.Client(timeout=options.fetch_timeout_s, follow_redirects=True, max_redirects=3,
                          trust_env=False) as client, client.stream("GET", url) as response:
            if response.status_code != 200:
                raise APIError(400, f"fetching the image failed: HTTP {response.status_code}", param)
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                raise _too_large(int(declared), limit, param)
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > limit:
                    raise _too_large(f"over {limit}", limit, param)
                if time.monotonic() > deadline:  # a server that drips bytes gets no more than the timeout
                    raise httpx.ReadTimeout("the whole fetch took too long")
            return bytes(data)
    except httpx.TimeoutException:
        raise APIError(400, f"fetching the image timed out after {options.fetch_timeout_s:g} s", param) from None
    except httpx.HTTPError as error:
        raise APIError(400, f"fetching the image failed: {type(error).__name__}: {error}", param) from None
