"""LLaVA-1.5 offline (issue 54): greedy float32 output token-exact against transformers with 1, 2 and 3 images of
different sizes (at the start, middle and end of a prompt), chunked through an image's placeholders and batched with a
text prompt; the encoder runs once per image; the prefix cache keys blocks by the images they cover; every bad input a
ValueError naming its cause."""
from __future__ import annotations

import base64
import io

import msgspec
import pytest
import torch
from transformers import AutoImageProcessor
from transformers import LlavaForConditionalGeneration as HFLlava

from conftest import assert_all_blocks_free, tiny_llava
from vision import FEATURES, hf_greedy, picture
from core.block_hash import extend_block_hashes
from frontend import LLM, SamplingParams, multimodal
from frontend.prompts import engine_request
from ipc import Decoder, EngineCoreRequest, Encoder
from ipc.multimodal import ImageInput
from ipc.request_rules import InvalidRequestError
from workers.model_config import load_hf_config
from workers.model_loader import checkpoint_target, load_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# 16-token steps cut through every image's 25 placeholders; 8-token blocks.
ENGINE = {"dtype": "float32", "block_size": 8, "max_model_len": 256, "max_num_batched_tokens": 16}


@pytest.fixture(scope="module")
def llm():
    engine = LLM(tiny_llava(), in_process=True, **ENGINE)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference():
    """transformers' own LLaVA and image processor on the same folder."""
    return HFLlava.from_pretrained(tiny_llava(), dtype=torch.float32).eval(), \
        AutoImageProcessor.from_pretrained(tiny_llava())


def encoder_cache(llm: LLM):
    return llm.client.engine.executor.worker.model_runner.encoder_cache




def test_greedy_matches_transformers_chunked_and_batched_with_text(llm, reference):
    one, two, three = picture(1), picture(2, 60, 33), picture(3, 33, 90)
    prompts = [{"prompt": "<image> What is in it?", "multi_modal_data": {"image": one}},
               {"prompt": "First <image> then <image>", "multi_modal_data": {"image": [two, three]}},
               "A prompt of text alone",
               {"prompt": "Say what you see: <image>", "multi_modal_data": {"image": [three]}}]
    cache = encoder_cache(llm)
    encoded = cache.num_encoded
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        images = prompt["multi_modal_data"]["image"] if isinstance(prompt, dict) else []
        images = images if isinstance(images, list) else [images]
        assert output.prompt_token_ids.count(llm.info.image_token_id) == FEATURES * len(images)
        assert output.outputs[0].token_ids == hf_greedy(reference, output.prompt_token_ids, images, 8), prompt
    assert cache.num_encoded - encoded == 3  # each distinct image once, though 16-token steps split each
    assert_all_blocks_free(llm)


def test_three_images_at_the_start_middle_and_end_match_transformers(llm, reference):
    """The first and the last prompt tokens are placeholders (the last one's logits are an image row's); 16-token
    steps cut through all three images."""
    images = [picture(30, 50, 35), picture(31, 33, 33), picture(32, 28, 71)]
    placeholder = llm.info.image_token_id
    words = llm.tokenizer("in the middle of two pictures", add_special_tokens=False)["input_ids"]
    ids = [placeholder] + words + [placeholder] + words + [placeholder]
    [output] = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)
    expanded = output.prompt_token_ids
    assert expanded[:FEATURES] == expanded[-FEATURES:] == [placeholder] * FEATURES
    assert expanded.count(placeholder) == 3 * FEATURES
    assert output.outputs[0].token_ids == hf_greedy(reference, expanded, images, 8)
    assert_all_blocks_free(llm)

def test_an_image_seen_before_is_not_encoded_again_and_shares_blocks(llm):
    image = picture(4)
    prompt = {"prompt": "<image> Describe the picture in a few words", "multi_modal_data": {"image": image}}
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    encoded, processed = encoder_cache(llm).num_encoded, llm.router.image_processor.num_processed
    again = llm.generate({**prompt, "multi_modal_data": {"image": image.copy()}}, GREEDY, use_tqdm=False)[0]
    assert encoder_cache(llm).num_encoded == encoded
    assert llm.router.image_processor.num_processed == processed  # nor processed again in the front end
    # Every full block is found again (the last prompt token is always computed).
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 8 * 8
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_same_text_with_another_image_shares_no_block_and_answers_differently(llm):
    text = "<image> Describe the picture in a few words"
    outputs = [llm.generate({"prompt": text, "multi_modal_data": {"image": picture(seed)}}, GREEDY,
                            use_tqdm=False)[0] for seed in (5, 6)]
    assert outputs[1].num_cached_tokens == 0
    assert outputs[0].prompt_token_ids == outputs[1].prompt_token_ids
    assert outputs[0].outputs[0].token_ids != outputs[1].outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_the_processed_image_cache_keeps_the_latest_images_within_its_bound(llm, monkeypatch):
    processor = llm.router.image_processor
    monkeypatch.setattr(multimodal, "PROCESSED_CACHE_BYTES", 2 * 3 * 33 * 33 * 4)  # two images' float32 pixels
    images = [picture(seed) for seed in (20, 21, 22)]
    placeholder = llm.info.image_token_id
    ids, inputs = processor.expand([7, placeholder, 8, placeholder, placeholder], images)
    assert [image.offset for image in inputs] == [1, 2 + FEATURES, 2 + 2 * FEATURES]
    assert ids == [7] + [placeholder] * FEATURES + [8] + [placeholder] * (2 * FEATURES)
    assert len(processor.processed) == 2 and multimodal.image_hash(images[0]) not in processor.processed


def test_block_hashes_carry_the_images_they_cover():
    def image(digest: str, offset: int) -> ImageInput:
        return ImageInput(bytes(4 * 3), "float32", (3, 1, 1), digest * 64, offset, 4)

    tokens = [1, 2, 3, 4] + [9] * 4 + [5, 6, 7, 8]
    hashes = {}
    for name in ("a", "b"):
        hashes[name] = []
        extend_block_hashes(hashes[name], tokens, 4, None, [image(name, 4)])
    same = []
    extend_block_hashes(same, tokens, 4, None, [image("a", 4)])
    assert hashes["a"][0] == hashes["b"][0]  # before the image: shared
    assert hashes["a"][1] != hashes["b"][1] and hashes["a"][2] != hashes["b"][2]  # from its first placeholder on
    assert same == hashes["a"]


def test_token_ids_and_processed_images_give_what_text_and_pil_images_give(llm):
    """The gateway's form: the templated prompt's token ids, the images processed off its event loop."""
    image = picture(11)
    text = {"prompt": "USER: <image> what is it? ASSISTANT:", "multi_modal_data": {"image": image}}
    [expected] = llm.generate(text, GREEDY, use_tqdm=False)
    ids = llm.tokenizer("USER: <image> what is it? ASSISTANT:")["input_ids"]
    processed = llm.router.image_processor.process([image])
    [got] = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": processed}}, GREEDY, use_tqdm=False)
    assert got.prompt_token_ids == expected.prompt_token_ids
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_bad_image_prompts_are_value_errors(llm):
    image = picture(7)
    cases = [({"prompt": "no placeholder", "multi_modal_data": {"image": image}}, "0 image placeholder"),
             ({"prompt": "<image> <image>", "multi_modal_data": {"image": image}}, "2 image placeholder"),
             ({"prompt_token_ids": [1, 2, 3], "multi_modal_data": {"image": image}}, "0 image placeholder"),
             ({"prompt": "<image>", "multi_modal_data": {"image": "cat.png"}}, "PIL.Image or a list of them, got str"),
             ({"prompt": "<image>", "multi_modal_data": {"image": [image, 3]}}, "got Image, int"),
             ({"prompt": "<image>", "multi_modal_data": {"video": [image]}}, "multi_modal_data must be")]
    for prompt, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt, GREEDY, use_tqdm=False)
    text_only = msgspec.structs.replace(llm.info, image_token_id=None, image_feature_count=0)
    with pytest.raises(ValueError, match="takes no images"):
        engine_request(llm.tokenizer, text_only, "r", {"prompt": "<image>", "multi_modal_data": {"image": image}},
                       GREEDY)
    assert_all_blocks_free(llm)


def test_the_engine_refuses_images_a_front_end_did_not_expand_or_whose_hash_is_not_theirs(llm):
    request = engine_request(llm.tokenizer, llm.info, "r", {"prompt": "x <image>", "multi_modal_data": {
        "image": picture(8)}}, GREEDY, image_processor=llm.router.image_processor)
    frames = Encoder().encode(request)
    decoded = Decoder(EngineCoreRequest).decode(frames)
    assert torch.equal(decoded.mm_inputs[0].tensor(), request.mm_inputs[0].tensor())
    text_only = msgspec.structs.replace(llm.info, image_token_id=None, image_feature_count=0)
    with pytest.raises(InvalidRequestError, match="takes no images"):
        text_only.validate_request(request)
    moved = msgspec.structs.replace(request, mm_inputs=[msgspec.structs.replace(request.mm_inputs[0], offset=0)])
    with pytest.raises(InvalidRequestError, match="must hold the image token"):
        llm.info.validate_request(moved)
    other = engine_request(llm.tokenizer, llm.info, "o", {"prompt": "x <image>", "multi_modal_data": {
        "image": picture(9)}}, GREEDY, image_processor=llm.router.image_processor).mm_inputs[0]
    forged = msgspec.structs.replace(request, mm_inputs=[msgspec.structs.replace(other, hash=request.mm_inputs[0].hash,
                                                                                 offset=request.mm_inputs[0].offset)])
    with pytest.raises(InvalidRequestError, match="sha256 of its pixel values"):  # another image's cache key
        llm.info.validate_request(forged)


def test_checkpoint_names_of_every_layout_load(llm):
    model = llm.client.engine.executor.worker.model_runner.model
    params = dict(model.named_parameters())
    names = {"model.language_model.layers.0.self_attn.q_proj.weight": "language_model.model.layers.0.self_attn.qkv_proj"
             ".weight",
             "language_model.model.layers.0.self_attn.q_proj.weight": "language_model.model.layers.0.self_attn.qkv_proj"
             ".weight",
             "vision_tower.vision_model.embeddings.class_embedding": "vision_tower.embeddings.class_embedding",
             "model.vision_tower.encoder.layers.0.self_attn.q_proj.weight":
                 "vision_tower.encoder.layers.0.self_attn.q_proj.weight",
             "model.multi_modal_projector.linear_1.weight": "multi_modal_projector.linear_1.weight",
             "lm_head.weight": "language_model.lm_head.weight"}
    for checkpoint_name, ours in names.items():
        assert checkpoint_target(checkpoint_name, params, model)[0] == ours, checkpoint_name
    assert checkpoint_target("vision_tower.post_layernorm.weight", params, model) is None  # never read


def test_a_preempted_image_request_recomputes_without_encoding_again(reference):
    # 12 blocks of 8 for three requests of 7 blocks each: the latest is preempted and computed again.
    engine = LLM(tiny_llava(), in_process=True, **(ENGINE | {"num_kv_blocks": 12, "max_model_len": 64}))
    try:
        images = [picture(seed) for seed in (10, 11, 12)]
        prompts = [{"prompt": f"<image> picture {i}", "multi_modal_data": {"image": image}}
                   for i, image in enumerate(images)]
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        outputs = engine.generate(prompts, params, use_tqdm=False)
        assert engine.get_stats().num_preemptions > 0
        assert encoder_cache(engine).num_encoded == 3
        for image, output in zip(images, outputs):
            assert output.outputs[0].token_ids == hf_greedy(reference, output.prompt_token_ids, [image], 24)
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("strategy", ["default", "full"])
def test_the_select_strategy_keeps_or_drops_the_class_token(reference, strategy):
    config = load_hf_config(tiny_llava())
    config.vision_feature_select_strategy = strategy
    ours = load_model(tiny_llava(), config, torch.float32, torch.device("cpu"))
    model, processor = reference
    pixels = processor([picture(13), picture(14, 20, 70)], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = model.model.get_image_features(pixel_values=pixels, vision_feature_layer=-2,
                                                  vision_feature_select_strategy=strategy).pooler_output
    assert ours.image_inputs(config)["image_feature_count"] == FEATURES + (strategy == "full")
    assert torch.allclose(ours.encode_images(pixels), torch.stack(list(expected)), atol=1e-6)


def test_chat_image_parts_render_as_placeholders(llm):
    image = picture(15)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    parts = [[{"type": "image_pil", "image_pil": image}, {"type": "text", "text": "What is it?"}],
             [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]]
    outputs = llm.chat([[{"role": "user", "content": content}] for content in parts], GREEDY, use_tqdm=False)
    expected = llm.generate({"prompt": "<|im_start|>user\n<image>What is it?<|im_end|>\n<|im_start|>assistant\n",
                             "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    for output in outputs:
        assert output.prompt_token_ids == expected.prompt_token_ids
        assert output.outputs[0].token_ids == expected.outputs[0].token_ids
    for bad_url, message in (("file:///etc/passwd", "must be a data: URL"), ("data:image/png;base64,@@", "base64")):
        with pytest.raises(ValueError, match=message):
            llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": bad_url}}]}])
    assert_all_blocks_free(llm)


def test_tensor_parallel_equals_transformers(reference):
    """Every rank holds the whole tower and encodes the image itself; the language model is split as ever."""
    images = [picture(16), picture(17, 70, 40)]
    engine = LLM(tiny_llava(), tensor_parallel_size=2, **ENGINE)
    try:
        output = engine.generate({"prompt": "a <image> b <image>", "multi_modal_data": {"image": images}}, GREEDY,
                                 use_tqdm=False)[0]
        assert output.outputs[0].token_ids == hf_greedy(reference, output.prompt_token_ids, images, 8)
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()
