"""Multi-LoRA: every request equals HF transformers + PEFT (the adapter applied, not merged) for its adapter, with
adapters of different ranks and base-model requests in one batch, slots swapped, chunked prefill, preemption and
the prefix cache on; bad adapters are clear errors while the engine serves on."""
from __future__ import annotations

import functools
import json
import os
import shutil
import time
import warnings
from pathlib import Path

import pytest
import torch

from conftest import _MODEL_ROOT, assert_all_blocks_free, random_prompts, tiny_model
from frontend import LLM, LoRARequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# name → (rank, alpha, targets, rslora, modules_to_save)
ADAPTERS = {
    "attention-r2": (2, 4, ["q_proj", "v_proj"], False, None),
    "everything-r8-rslora": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                             True, None),
    "mlp-r4-saved-head": (4, 8, ["down_proj", "up_proj"], False, ["lm_head", "embed_tokens"]),
}


@functools.cache
def adapter_dir(name: str, arch: str = "llama") -> str:
    """A PEFT adapter folder with random (non-zero) A and B, made once per session."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    warnings.filterwarnings("ignore")
    rank, alpha, targets, rslora, saved = ADAPTERS[name]
    torch.manual_seed(rank)
    base = AutoModelForCausalLM.from_pretrained(tiny_model(arch), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, modules_to_save=saved,
                        init_lora_weights=False)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for module_name, param in model.named_parameters():
            if "lora_B" in module_name:  # PEFT's random B is tiny: make the adapters change the outputs
                param.normal_(0, 0.3)
            if "modules_to_save" in module_name:
                param.add_(torch.randn_like(param) * 0.5)
    folder = _MODEL_ROOT / f"{arch}-tiny-lora-{name}"
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder)
    return str(folder)


def lora(name: str, int_id: int, arch: str = "llama") -> LoRARequest:
    return LoRARequest(name, int_id, adapter_dir(name, arch))


@functools.cache
def _peft_model(name: str | None, arch: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model(arch), dtype=torch.float32).eval()
    return base if name is None else PeftModel.from_pretrained(base, adapter_dir(name, arch)).eval()


@torch.inference_mode()
def peft_greedy(name: str | None, prompt: list[int], max_new_tokens: int, arch: str = "llama") -> list[int]:
    model = _peft_model(name, arch)
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, min_new_tokens=0, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_mixed_adapters_equal_peft_with_slot_swaps_chunks_preemption_and_prefix_cache():
    """Three adapters (ranks 2, 8 with rslora, 4 with its own LM head and embeddings) and the base model, every
    prompt twice in the second pass (prefix-cache hits), max_loras=2 so that slots are swapped; 37-token steps
    chunk the prompts and 40 blocks of 8 force preemption."""
    names = [None, *ADAPTERS]
    prompts = random_prompts([5, 40, 90, 17, 64, 33, 120, 9], vocab=1000)
    requests = [(p, names[i % len(names)]) for i, p in enumerate(prompts)]
    ids = {name: i + 1 for i, name in enumerate(ADAPTERS)}
    llm = LLM(tiny_model("llama"), dtype="float32", in_process=True, enable_lora=True, max_loras=2,
              max_lora_rank=8, max_cpu_loras=2, max_num_batched_tokens=37, block_size=8, num_kv_blocks=40,
              max_model_len=256,
              enable_prefix_caching=True)
    try:
        for _ in range(2):
            outputs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], GREEDY, use_tqdm=False,
                                   lora_request=[None if n is None else lora(n, ids[n]) for _, n in requests])
            for (prompt, name), output in zip(requests, outputs):
                assert output.outputs[0].token_ids == peft_greedy(name, prompt, GREEDY.max_tokens), (name, len(prompt))
        stats = llm.get_stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_adapter_steps_run_on_the_cpp_layer_and_equal_the_op_path(monkeypatch):
    """Decodes and short chunks of adapted requests beside base-model ones take the C++ layer, which adds each
    row's deltas (kernels/csrc/lora.h): float32, the same tokens and logprobs as the op path (bf16 against float32:
    tests/test_cpu_decoder_layer.py's adapter case)."""
    from kernels import cpu_decoder_layer

    prompts = random_prompts([5, 30, 17, 9], vocab=1000, seed=3)
    names = [None, *ADAPTERS]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    adapted_calls = []
    layers = cpu_decoder_layer.decoder_layers
    monkeypatch.setattr(cpu_decoder_layer, "decoder_layers", lambda *args: adapted_calls.append(
        args[4] is not None and bool((args[4] >= 0).any())) or layers(*args))

    def run() -> list:
        llm = LLM(tiny_model("llama"), dtype="float32", in_process=True, enable_lora=True, max_loras=3,
                  max_lora_rank=8)
        try:
            return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                                lora_request=[None if n is None else lora(n, i + 1) for i, n in enumerate(names)])
        finally:
            llm.shutdown()

    fused = run()
    assert any(adapted_calls), "no adapted step took the C++ layer"
    monkeypatch.setattr(cpu_decoder_layer, "decode_step", lambda *args: None)
    for got, expected in zip(fused, run(), strict=True):
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids
        for got_step, expected_step in zip(got.outputs[0].logprobs, expected.outputs[0].logprobs):
            for token, logprob in got_step.items():
                assert logprob.logprob == pytest.approx(expected_step[token].logprob, abs=1e-4)


def test_adapted_multi_step_calls_take_one_cpp_call_and_equal_peft(monkeypatch):
    """Multi-step calls of adapted requests beside a base-model one take their later steps in the model's one C++
    call (greedy_decode adds each row's deltas in the layers): PEFT's tokens."""
    from workers.fast_path.later_step_calls import LaterStepCalls

    prompts = random_prompts([5, 30, 17], vocab=1000, seed=5)
    names = [None, "attention-r2", "everything-r8-rslora"]
    calls = []
    in_one_call = LaterStepCalls._in_one_call
    monkeypatch.setattr(LaterStepCalls, "_in_one_call",
                        lambda self, *args: calls.append(in_one_call(self, *args)) or calls[-1])
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm = LLM(tiny_model("llama"), dtype="float32", in_process=True, enable_lora=True, max_loras=2, max_lora_rank=8,
              num_scheduler_steps=8, multi_step_budget_ms=None)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                               lora_request=[None if n is None else lora(n, i + 1) for i, n in enumerate(names)])
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()
    assert any(calls), "no multi-step call of adapted requests took the C++ call"
    for prompt, name, output in zip(prompts, names, outputs, strict=True):
        assert output.outputs[0].token_ids == peft_greedy(name, prompt, params.max_tokens), name


def test_adapters_change_outputs_and_never_share_prefix_blocks():
    """The same prompt under the base model and two adapters: three different continuations, each as PEFT's; a
    block computed under one is never reused for another (their first pass hits nothing of the others')."""
    prompt = random_prompts([64], vocab=1000)[0]
    llm = LLM(tiny_model("llama"), dtype="float32", in_process=True, enable_lora=True, max_loras=2, block_size=8,
              enable_prefix_caching=True)
    try:
        outputs = {}
        for name, request in ((None, None), ("attention-r2", lora("attention-r2", 1)),
                              ("everything-r8-rslora", lora("everything-r8-rslora", 2))):
            [output] = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False, lora_request=request)
            assert output.num_cached_tokens == 0, name
            outputs[name] = output.outputs[0].token_ids
            assert outputs[name] == peft_greedy(name, prompt, GREEDY.max_tokens), name
        assert len({tuple(o) for o in outputs.values()}) == 3
    finally:
        llm.shutdown()


def test_adapter_requests_need_enable_lora():
    llm = LLM(tiny_model("llama"), dtype="float32", in_process=True)
    try:
        with pytest.raises(ValueError, match="start it with enable_lora=True"):
            llm.generate({"prompt_token_ids": [5, 6]}, GREEDY, use_tqdm=False, lora_request=lora("attention-r2", 1))
    finally:
        llm.shutdown()


def _broken(tmp_path: Path, name: str, edit) -> str:
    folder = tmp_path / name
    shutil.copytree(adapter_dir("attention-r2"), folder)
    edit(folder)
    return str(folder)


def _other_targets(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "adapter_model.safetensors"))
    save_file({k.replace("self_attn.q_proj", "self_attn.query_key_value"): v for k, v in tensors.items()},
              str(folder / "adapter_model.safetensors"))


def _config(folder: Path, **changes) -> None:
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("case, edit, message", [
    ("no-match", _other_targets, "match no module of this model"),
    ("corrupt", lambda f: (f / "adapter_model.safetensors").write_bytes(b"\x00" * 40), "is unreadable"),
    ("dora", lambda f: _config(f, use_dora=True), "DoRA"),
    ("no-config", lambda f: (f / "adapter_config.json").unlink(), "cannot read adapter_config.json")])
def test_bad_adapters_are_clear_errors_and_the_engine_serves_on(tmp_path, case, edit, message):
    llm = LLM(tiny_model("llama"), dtype="float32", in_process=True, enable_lora=True, max_lora_rank=8)
    try:
        with pytest.raises(ValueError, match=message):
            llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False,
                         lora_request=LoRARequest(case, 7, _broken(tmp_path, case, edit)))
        [output] = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False,
                                lora_request=lora("attention-r2", 1))
        assert output.outputs[0].token_ids == peft_greedy("attention-r2", [5, 6, 7], GREEDY.max_tokens)
    finally:
        llm.shutdown()


def test_a_rank_above_max_lora_rank_is_refused():
    llm = LLM(tiny_model("llama"), dtype="float32", in_process=True, enable_lora=True, max_lora_rank=4)
    try:
        with pytest.raises(ValueError, match="rank 8 of .* exceeds max_lora_rank 4"):
            llm.generate({"prompt_token_ids": [5, 6]}, GREEDY, use_tqdm=False,
                         lora_request=lora("everything-r8-rslora", 2))
    finally:
        llm.shutdown()


def offline_text(prompt: list[int], max_tokens: int, adapter: LoRARequest | None) -> str:
    """The text the offline engine (whose tokens equal PEFT's, above) writes for the prompt under the adapter."""
    llm = LLM(tiny_model("llama"), dtype="float32", in_process=True, enable_lora=True, max_lora_rank=8)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        [output] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False, lora_request=adapter)
    finally:
        llm.shutdown()
    assert output.outputs[0].token_ids == peft_greedy(None if adapter is None else adapter.lora_name, prompt,
                                                      max_tokens)
    return output.outputs[0].text


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory) -> Path:
    """The runtime adapter folder: one good adapter, and folders whose files are a FIFO, a device, or a symlink out."""
    lora_dir = tmp_path_factory.mktemp("adapters")
    shutil.copytree(adapter_dir("everything-r8-rslora"), lora_dir / "everything")
    for name in ("fifo", "device"):
        shutil.copytree(adapter_dir("attention-r2"), lora_dir / name)
    (lora_dir / "fifo" / "adapter_config.json").unlink()
    os.mkfifo(lora_dir / "fifo" / "adapter_config.json")  # reading it would wait for a writer forever
    (lora_dir / "device" / "adapter_model.safetensors").unlink()
    (lora_dir / "device" / "adapter_model.safetensors").symlink_to("/dev/zero")  # never ends
    (lora_dir / "outside").symlink_to(adapter_dir("attention-r2"), target_is_directory=True)
    return lora_dir


@pytest.fixture(scope="module")
def lora_server(lora_dir):
    """The base URL of the launcher with one adapter from --lora-modules and runtime loading from --lora-dir,
    behind an API key."""
    from launcher import start_launcher, stop_launcher

    process, base_url = start_launcher(
        ["--model", tiny_model("llama"), "--dtype", "float32", "--enable-lora", "--max-loras", "2",
         "--max-lora-rank", "8", "--lora-modules", f"attn={adapter_dir('attention-r2')}", "--allow-runtime-lora",
         "--lora-dir", str(lora_dir), "--api-key", "secret",
         "--gpu-memory-utilization", "0.4"])  # on a GPU, the offline engines of the tests beside it need room
    yield base_url
    stop_launcher(process)


def test_http_model_selects_the_adapter_and_models_lists_it(lora_server):
    import openai

    client = openai.OpenAI(base_url=lora_server + "/v1", api_key="secret")
    models = {m.id: m for m in client.models.list().data}
    base = next(name for name, m in models.items() if m.model_extra["parent"] is None)
    assert models["attn"].model_extra["parent"] == base
    prompt = random_prompts([20], vocab=1000)[0]
    texts = set()
    for model, adapter in ((base, None), ("attn", lora("attention-r2", 1))):
        completion = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0.0,
                                               extra_body={"ignore_eos": True})
        assert completion.model == model
        assert completion.choices[0].text == offline_text(prompt, 8, adapter)
        texts.add(completion.choices[0].text)
    assert len(texts) == 2
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)


def test_http_runtime_loading_only_from_under_the_lora_dir(lora_server):
    import httpx

    headers = {"Authorization": "Bearer secret"}
    load = lambda body: httpx.post(lora_server + "/v1/load_lora_adapter", json=body, headers=headers)  # noqa: E731
    assert httpx.post(lora_server + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "everything"}
                      ).status_code == 401
    for path in ("../", adapter_dir("attention-r2"), "missing"):
        response = load({"lora_name": "x", "lora_path": path})
        assert response.status_code == 400 and response.json()["error"]["param"] == "lora_path", response.text
    assert load({"lora_name": "every", "lora_path": "everything"}).status_code == 200
    prompt = random_prompts([12], vocab=1000)[0]
    body = {"model": "every", "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    choice = httpx.post(lora_server + "/v1/completions", json=body, headers=headers).json()["choices"][0]
    assert choice["text"] == offline_text(prompt, 6, lora("everything-r8-rslora", 2))
    assert httpx.post(lora_server + "/v1/unload_lora_adapter", json={"lora_name": "every"},
                      headers=headers).status_code == 200
    assert httpx.post(lora_server + "/v1/completions", json=body, headers=headers).status_code == 404


@pytest.mark.parametrize("folder", ["fifo", "device", "outside", "every\x00thing"])
def test_hostile_adapter_paths_are_refused_at_once_over_http(lora_server, folder):
    import httpx

    start = time.monotonic()
    response = httpx.post(lora_server + "/v1/load_lora_adapter", json={"lora_name": "h", "lora_path": folder},
                          headers={"Authorization": "Bearer secret"}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "lora_path", response.text
    assert time.monotonic() - start < 1.0
    assert httpx.get(lora_server + "/health").status_code == 200


def test_hostile_adapter_folders_are_refused_by_the_engine_at_once(lora_dir):
    """Over the engine's socket, as any ZMQ client would name them: the engine checks files and folders itself."""
    llm = LLM(tiny_model("llama"), dtype="float32", enable_lora=True, max_lora_rank=8, lora_dirs=[str(lora_dir)])
    try:
        for name, message in (("fifo", "not a regular file"), ("device", "not a regular file"),
                              ("outside", "not under a folder this engine serves")):
            start = time.monotonic()
            with pytest.raises(ValueError, match=message):
                llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False,
                             lora_request=LoRARequest(name, 7, str(lora_dir / name)))
            assert time.monotonic() - start < 1.0, name
        [output] = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False,
                                lora_request=LoRARequest("everything", 2, str(lora_dir / "everything")))
        assert output.outputs[0].token_ids == peft_greedy("everything-r8-rslora", [5, 6, 7], GREEDY.max_tokens)
    finally:
        llm.shutdown()
