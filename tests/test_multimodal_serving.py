"""LLaVA-1.5 served (issue 54): an image chat through the official openai client answers what the engine answers
offline for the same templated prompt and image, streams the same text, takes n, and a bad image is a 400 while the
server serves on."""
from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest
from PIL import Image
from transformers import AutoTokenizer

from conftest import tiny_llava
from frontend import LLM, SamplingParams
from launcher import start_launcher, stop_launcher

FEATURES = 25  # the tiny tower's 5 × 5 patches (launch/make_vision_model.py)


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
def client():
    process, base_url = start_launcher(["--model", tiny_llava(), "--dtype", "float32", "--max-model-len", "256"])
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
