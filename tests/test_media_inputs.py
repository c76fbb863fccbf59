"""Images in chat requests: media loading (data: URLs, allowed local files, remote fetches) and its checks, unit by
unit, then through the demo gateway with the official openai client: each bad image a 400 naming its cause, the
per-prompt limit, and a good image refused by the text-only demo model."""
from __future__ import annotations

import asyncio
import base64
import http.server
import io
import os
import struct
import threading
import time
import zlib
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from PIL import Image

from conftest import API_KEY, AUTH
from frontend.api.cli_args import build_parser, media_options
from frontend.api.errors import APIError
from frontend.api.media import MAX_IMAGE_PIXELS, MediaOptions, load_image, load_images
from ipc.multimodal import MAX_IMAGES_PER_PROMPT
from launch.shipped import DEMO_MODEL_NAME
from launcher import start_launcher, stop_launcher

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_BYTES = 60_000  # the server's --max-image-bytes in these tests


def encoded(image: Image.Image, kind: str = "PNG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, kind, **options)
    return buffer.getvalue()


def noise(width: int = 32, height: int = 24) -> Image.Image:
    """Random pixels: a file that does not compress, so cutting it short truncates its pixel data."""
    return Image.frombytes("RGB", (width, height), os.urandom(width * height * 3))


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A valid PNG whose header claims width x height pixels over a few bytes of data (a decompression bomb)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


BIG_PNG = encoded(noise(200, 120))  # over MAX_BYTES
BAD_DATA = [  # (what, URL, words the 400's message holds)
    ("not base64", "data:image/png," + "iVBORw0KGgo", "not base64"),
    ("bad base64", "data:image/png;base64,iVBO*w0KGgo=", "not valid base64"),
    ("not an image type", data_url(encoded(noise()), "text/plain"), "not an image type"),
    ("corrupt", data_url(b"\x89PNG\r\n\x1a\n" + os.urandom(200)), "corrupt PNG"),
    ("truncated", data_url(encoded(noise())[:900]), "truncated"),
    ("unsupported", data_url(encoded(noise(), "TIFF"), "image/tiff"), "unsupported image format"),
    ("bomb", data_url(png_header_only(30_000, 30_000)), "decompression bomb"),
    ("just over the pixel cap", data_url(png_header_only(8_000, MAX_IMAGE_PIXELS // 8_000 + 1)), "pixels"),
    ("too many bytes", data_url(BIG_PNG), "over this server's limit of"),
    ("unknown scheme", "ftp://127.0.0.1/cat.png", "scheme 'ftp' is not supported"),
]


def refused(url: str, options: MediaOptions) -> str:
    with pytest.raises(APIError) as caught:
        load_image(url, options)
    assert caught.value.status == 400
    return caught.value.message


@pytest.mark.parametrize("kind", FORMATS)
def test_each_supported_format_decodes_to_rgb(kind):
    original = Image.new("RGB", (13, 7), (200, 40, 90))
    image = load_image(data_url(encoded(original, kind), f"image/{kind.lower()}"), MediaOptions())
    assert image.size == (13, 7) and image.mode == "RGB"
    assert all(abs(a - b) <= 8 for a, b in zip(image.getpixel((6, 3)), (200, 40, 90)))  # JPEG/WEBP are lossy


def test_a_gif_gives_its_first_frame():
    frames = [Image.new("RGB", (8, 8), color) for color in ((255, 0, 0), (0, 0, 255))]
    gif = encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert load_image(data_url(gif, "image/gif"), MediaOptions()).getpixel((4, 4)) == (255, 0, 0)


@pytest.mark.parametrize("what,url,words", BAD_DATA, ids=[case[0] for case in BAD_DATA])
def test_a_bad_image_is_a_400_naming_the_cause(what, url, words):
    assert words in refused(url, MediaOptions(max_image_bytes=MAX_BYTES))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    """allowed/ (an image, a symlink out, a FIFO) beside outside/ (an image)."""
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "outside").mkdir()
    (root / "allowed" / "cat.png").write_bytes(encoded(Image.new("RGB", (5, 4), "white")))
    (root / "outside" / "secret.png").write_bytes(encoded(Image.new("RGB", (5, 4), "black")))
    (root / "allowed" / "link.png").symlink_to(root / "outside" / "secret.png")
    os.mkfifo(root / "allowed" / "pipe.png")
    return root


def test_local_files_only_under_the_allowed_folder(media_dir):
    allowed = MediaOptions(allowed_local_path=(media_dir / "allowed").resolve())
    assert load_image(f"file://{media_dir}/allowed/cat.png", allowed).size == (5, 4)
    assert "--allowed-local-media-path" in refused(f"file://{media_dir}/allowed/cat.png", MediaOptions())
    for escape in ("outside/secret.png", "allowed/../outside/secret.png", "allowed/link.png"):
        assert "outside the folder" in refused(f"file://{media_dir}/{escape}", allowed)
    assert "No such file" in refused(f"file://{media_dir}/allowed/none.png", allowed)
    assert "not name a regular file" in refused(f"file://{media_dir}/allowed/pipe.png", allowed)  # and no hang
    assert "NUL byte" in refused(f"file://{media_dir}/allowed/cat.png%00.txt", allowed)
    assert "only local files" in refused(f"file://example.org{media_dir}/allowed/cat.png", allowed)


class _Images(http.server.BaseHTTPRequestHandler):
    """/cat.png: a small image; /big.png: one over MAX_BYTES (its length unsaid); /slow.png: 3 s late."""

    def do_GET(self) -> None:
        if self.path == "/slow.png":
            time.sleep(3)
        body = {"/cat.png": encoded(Image.new("RGB", (6, 3), "red")), "/slow.png": b"", "/big.png": BIG_PNG}.get(
            self.path)
        self.send_response(404 if body is None else 200)
        if self.path != "/big.png":
            self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        try:
            self.wfile.write(body or b"")
        except OSError:  # the slow image's client has given up
            pass

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server of images on 127.0.0.1: its base URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_remote_images_only_with_the_flag_within_size_and_time(image_host):
    assert "--allow-remote-media" in refused(f"{image_host}/cat.png", MediaOptions())
    remote = MediaOptions(allow_remote=True, max_image_bytes=MAX_BYTES, fetch_timeout_s=1.0)
    assert load_image(f"{image_host}/cat.png", remote).size == (6, 3)
    assert "over this server's limit" in refused(f"{image_host}/big.png", remote)
    assert "HTTP 404" in refused(f"{image_host}/none.png", remote)
    started = time.monotonic()
    assert "timed out after 1 s" in refused(f"{image_host}/slow.png", remote)
    assert time.monotonic() - started < 2.5


def test_loading_leaves_the_event_loop_free(image_host):
    """A slow fetch runs on the media threads: the loop keeps ticking while it waits."""
    async def run() -> int:
        ticks = 0
        loading = asyncio.ensure_future(load_images([(f"{image_host}/slow.png", "url")],
                                                    MediaOptions(allow_remote=True, fetch_timeout_s=1.0)))
        while not loading.done():
            await asyncio.sleep(0.02)
            ticks += 1
        with pytest.raises(APIError, match="timed out"):
            loading.result()
        return ticks
    assert asyncio.run(run()) >= 20


def test_the_flags_default_to_data_urls_only_and_take_both_limit_forms(tmp_path):
    defaults = media_options(build_parser().parse_args(["--engine-address", "x"]))
    assert defaults.allowed_local_path is None and not defaults.allow_remote
    for form in ("image=2", '{"image": 2}'):
        args = build_parser().parse_args(["--engine-address", "x", "--limit-mm-per-prompt", form,
                                          "--allowed-local-media-path", str(tmp_path)])
        assert media_options(args).max_images_per_prompt == 2
        assert media_options(args).allowed_local_path == tmp_path.resolve()
    for bad in ("image", "video=1", "image=-1", f"image={MAX_IMAGES_PER_PROMPT + 1}", '{"image": "x"}', "[2]"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--engine-address", "x", "--limit-mm-per-prompt", bad])
    with pytest.raises(ValueError, match="not an existing folder"):
        media_options(build_parser().parse_args(["--engine-address", "x", "--allowed-local-media-path",
                                                 str(tmp_path / "none")]))


@pytest.fixture(scope="module")
def gateway(media_dir, image_host):
    """The demo gateway taking local files under allowed/, remote images, at most 2 per prompt: its base URL."""
    process, base_url = start_launcher(["--api-key", API_KEY, "--allowed-local-media-path", str(media_dir / "allowed"),
                                        "--allow-remote-media", "--media-fetch-timeout", "1",
                                        "--max-image-bytes", str(MAX_BYTES), "--limit-mm-per-prompt", "image=2"])
    yield base_url
    stop_launcher(process)


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=API_KEY, max_retries=0)


def chat_error(client: openai.OpenAI, *urls: str, part: dict | None = None) -> dict:
    """The error body of a chat with these image parts (a 400)."""
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls] + ([part] if part else [])
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=DEMO_MODEL_NAME, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is in it?"}, *parts]}])
    assert caught.value.status_code == 400
    return caught.value.body


def test_each_bad_image_over_http_is_a_400_and_the_gateway_serves_on(client, media_dir, image_host):
    for what, url, words in BAD_DATA:
        error = chat_error(client, url)
        assert words in error["message"] and error["param"] == "messages.0.content.1.image_url.url", what
    for url, words in ((f"file://{media_dir}/allowed/link.png", "outside the folder"),
                       (f"{image_host}/slow.png", "timed out"), (f"{image_host}/big.png", "over this server's")):
        assert words in chat_error(client, url)["message"]
    assert chat_error(client, part={"type": "image_url", "image_url": {}})["param"] == "messages.0.content.1.image_url"
    assert chat_error(client, part={"type": "image_url", "image_url": {"url": "x", "detail": "max"}})["param"] == (
        "messages.0.content.1.image_url.detail")
    answer = client.chat.completions.create(model=DEMO_MODEL_NAME, max_tokens=2,
                                            messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert answer.choices[0].finish_reason in ("length", "stop")


def test_images_per_prompt_are_counted_before_any_is_loaded(client):
    error = chat_error(client, *["data:image/png,not-even-base64"] * 3)
    assert "3 images in one prompt, over this server's limit of 2" in error["message"]


def test_a_good_image_on_the_text_only_model_says_it_does_not_accept_images(client, media_dir, image_host):
    good = data_url(encoded(Image.new("RGB", (9, 9), "green")))
    for urls in ((good,), (f"file://{media_dir}/allowed/cat.png", f"{image_host}/cat.png")):
        assert "does not accept images" in chat_error(client, *urls)["message"]


def test_tokenize_refuses_image_parts(gateway):
    content = [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]
    response = httpx.post(f"{gateway}/tokenize", headers=AUTH, timeout=60,
                          json={"messages": [{"role": "user", "content": content}]})
    assert response.status_code == 400 and "counts text only" in response.json()["error"]["message"]


def test_anthropic_image_blocks_are_checked_as_chat_images_are(gateway, image_host):
    client = anthropic.Anthropic(base_url=gateway, api_key=API_KEY, max_retries=0)
    png = base64.b64encode(encoded(Image.new("RGB", (9, 9), "green"))).decode()
    for source, words in (({"type": "base64", "media_type": "image/png", "data": png}, "does not accept images"),
                          ({"type": "url", "url": f"{image_host}/cat.png"}, "does not accept images"),
                          ({"type": "base64", "media_type": "image/png", "data": png[:-7]}, "not valid base64"),
                          ({"type": "base64", "media_type": "image/tiff", "data": BAD_DATA[5][1].split(",")[1]},
                           "unsupported image format")):
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(model=DEMO_MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image", "source": source}, {"type": "text", "text": "What is in it?"}]}])
        assert words in caught.value.body["error"]["message"], source
