"""LLaVA-1.5 served (issue 54): an image chat through the official openai client answers what the engine answers
offline for the same templated prompt and image, streams the same text, takes n, and a bad image is a 400 while the
server serves on. The Responses API's input_image parts (data: and allowed file:// URLs) answer as the chat route
does, whole and streamed, and continue by previous_response_id; each bad one is a 400 naming the input part."""
from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image
from transformers import AutoTokenizer

from conftest import tiny_llava
from frontend import LLM, SamplingParams
from frontend.api.responses_output import ResponseStore, StoredResponse
from launcher import start_launcher, stop_launcher

FEATURES = 25  # the tiny tower's 5 × 5 patches (launch/make_vision_model.py)
MAX_IMAGE_BYTES = 100_000  # the server's --max-image-bytes: the pictures here are a few kilobytes


def picture(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (37, 45, 3), dtype=np.uint8))


def data_url(image: Image.Image, keep: float = 1.0) -> str:
    """The image as a PNG data URL (its first `keep` share of bytes)."""
    encoded = io.BytesIO()
    image.save(encoded, format="PNG")
    data = encoded.getvalue()
    return "data:image/png;base64," + base64.b64encode(data[:int(len(data) * keep)]).decode()


def messages(image: Image.Image) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "what is in"},
                                         {"type": "image_url", "image_url": {"url": data_url(image)}},
                                         {"type": "text", "text": "?"}]}]


@pytest.fixture(scope="module")
def media_folder(tmp_path_factory) -> Path:
    """The folder the server reads file:// images from."""
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def client(media_folder):
    process, base_url = start_launcher(["--model", tiny_llava(), "--dtype", "float32", "--max-model-len", "256",
                                        "--allowed-local-media-path", str(media_folder),
                                        "--max-image-bytes", str(MAX_IMAGE_BYTES)])
    yield openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    stop_launcher(process)


def offline_text(image: Image.Image, max_tokens: int) -> str:
    """The engine's greedy answer to the prompt the gateway builds: the chat template's text with an image part as
    {"type": "image"}, its token ids as they are (no special tokens added)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llava())
    rendered = [{"role": "user", "content": [{"type": "text", "text": "what is in"}, {"type": "image"},
                                             {"type": "text", "text": "?"}]}]
    text = tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    llm = LLM(tiny_llava(), in_process=True, dtype="float32", max_model_len=256)
    try:
        [output] = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image}},
                                SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                                use_tqdm=False)
        return output.outputs[0].text
    finally:
        llm.shutdown()


def test_an_image_chat_answers_streams_and_takes_n_as_the_engine_does(client):
    image = picture(3)
    asked = dict(model=tiny_llava(), messages=messages(image), temperature=0.0, max_tokens=10,
                 extra_body={"ignore_eos": True})
    answer = client.chat.completions.create(**asked, n=2)
    assert [choice.message.content for choice in answer.choices] == [offline_text(image, 10)] * 2
    assert answer.usage.prompt_tokens > FEATURES  # the placeholder became the image's features
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(**asked, stream=True) if chunk.choices)
    assert streamed == answer.choices[0].message.content
    other = client.chat.completions.create(**{**asked, "messages": messages(picture(4))})
    assert other.usage.prompt_tokens == answer.usage.prompt_tokens


def test_a_bad_image_is_a_400_and_the_server_serves_on(client):
    broken = messages(picture(5))
    broken[0]["content"][1]["image_url"]["url"] = data_url(picture(5), keep=0.5)
    with pytest.raises(openai.BadRequestError, match="truncated|corrupt"):
        client.chat.completions.create(model=tiny_llava(), messages=broken, max_tokens=4)
    answer = client.chat.completions.create(model=tiny_llava(), messages=messages(picture(6)), max_tokens=4,
                                            temperature=0.0, extra_body={"ignore_eos": True})
    assert answer.choices[0].finish_reason == "length"


def image_input(url: str, **image: str) -> list[dict]:
    """The chat `messages(...)` question as Responses input: the same text around an input_image part."""
    return [{"role": "user", "content": [{"type": "input_text", "text": "what is in"},
                                         {"type": "input_image", "image_url": url, **image},
                                         {"type": "input_text", "text": "?"}]}]


def test_responses_input_images_answer_as_the_chat_route_does(client, media_folder):
    image = picture(21)
    chat = client.chat.completions.create(model=tiny_llava(), messages=messages(image), temperature=0.0,
                                          max_tokens=12)
    expected = chat.choices[0].message.content
    assert expected  # an answer of some text, or the comparisons below compare nothing
    image.save(media_folder / "picture.png")
    for url, detail in ((data_url(image), "auto"), ((media_folder / "picture.png").as_uri(), "low")):
        response = client.responses.create(model=tiny_llava(), input=image_input(url, detail=detail),
                                           temperature=0.0, max_output_tokens=12)
        assert response.output_text == expected, url[:40]
        assert response.usage.input_tokens == chat.usage.prompt_tokens
    events = list(client.responses.create(model=tiny_llava(), input=image_input(data_url(image)), temperature=0.0,
                                          max_output_tokens=12, stream=True))
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == expected
    assert events[-1].type == f"response.{response.status}" and events[-1].response.output_text == expected
    items = client.responses.input_items.list(response.id, order="asc").data
    assert items[0].content[1].type == "input_image" and items[0].content[1].image_url == url
    later = client.responses.create(model=tiny_llava(), input="and then?", previous_response_id=response.id,
                                    temperature=0.0, max_output_tokens=4)
    assert later.usage.input_tokens > response.usage.input_tokens + response.usage.output_tokens  # the image again


def test_bad_responses_images_are_400s_naming_the_part_and_the_server_serves_on(client, media_folder):
    big = Image.fromarray(np.random.default_rng(0).integers(0, 256, (200, 200, 3), dtype=np.uint8))
    outside = media_folder.parent / "outside.png"
    picture(22).save(outside)
    cases = [(data_url(picture(22), keep=0.5), "truncated|corrupt"), (data_url(big), "too large"),
             ("https://example.com/cat.png", "not fetched"), (outside.as_uri(), "outside the folder"),
             ("data:text/plain;base64,aGk=", "not an image type")]
    for url, message in cases:
        with pytest.raises(openai.BadRequestError, match=message) as raised:
            client.responses.create(model=tiny_llava(), input=image_input(url), instructions="Answer briefly.",
                                    max_output_tokens=4)
        assert raised.value.body["param"] == "input.0.content.1.image_url", url[:40]
    too_many = [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(picture(23))}] * 5}]
    with pytest.raises(openai.BadRequestError, match="5 images in one prompt, over this server's limit of 4"):
        client.responses.create(model=tiny_llava(), input=too_many, max_output_tokens=4)
    for part, message in (({"file_id": "file-1"}, "uploaded files are not stored"), ({"detail": "huge"}, "detail")):
        with pytest.raises(openai.BadRequestError, match=message):
            client.responses.create(model=tiny_llava(), input=image_input(data_url(picture(23)), **part),
                                    max_output_tokens=4)
    answer = client.responses.create(model=tiny_llava(), input=image_input(data_url(picture(24))),
                                     max_output_tokens=4)
    assert answer.status in ("completed", "incomplete") and answer.usage.input_tokens > FEATURES


def test_the_response_store_bounds_the_image_bytes_it_keeps():
    def stored(url: str) -> StoredResponse:
        return StoredResponse([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]},
                               {"role": "assistant", "content": "a cat"}], {}, [])

    store = ResponseStore(10, max_image_bytes=100)
    store.put("a", stored("x" * 60))
    store.put("b", stored("y" * 30))
    assert list(store.responses) == ["a", "b"] and store.image_bytes == 90
    store.put("c", stored("z" * 30))  # over 100 bytes: the least recently used goes
    assert list(store.responses) == ["b", "c"] and store.image_bytes == 60
    store.put("d", stored("w" * 101))  # over the bound alone: not kept
    assert "d" not in store.responses and store.image_bytes == 60
    store.delete("b")
    assert store.image_bytes == 30
