"""DeepSeek-V3's multi-token-prediction layer as the proposer (speculative_config method "mtp"): the drafts equal a
float32 reference built on transformers' decoder layer over each whole context, and never change greedy output."""
from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import random_prompts, tiny_model, tiny_mtp_model
from core import EngineCore
from ipc import EngineConfig, EngineCoreOutputs, EngineCoreRequest, SamplingParams
from launch.mtp_layer import load_mtp_layer
from workers.model_runner import ModelRunner
from workers.spec_decode.mtp import MtpLayer, MtpProposer, MtpStage

ENGINE = {"dtype": "float32", "block_size": 8, "max_model_len": 128}
MTP = {"method": "mtp", "num_speculative_tokens": 3, "disable_by_batch_size": None}


@pytest.fixture(scope="module")
def mtp_model() -> str:
    """The tiny DeepSeek-V3 with a random MTP layer written beside its weights."""
    return tiny_mtp_model()


def _run(model: str, prompts: list[list[int]], params: list[SamplingParams], spec: dict | None = None,
         **engine_args) -> tuple[dict[str, list[int]], EngineCore]:
    """Each request's tokens; every block back in the pool."""
    engine = EngineCore(EngineConfig(model=model, speculative_config=spec, **{**ENGINE, **engine_args}))
    tokens: dict[str, list[int]] = {}
    try:
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            engine.add_request(EngineCoreRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=sp))
            tokens[f"r{i}"] = []
        while engine.has_unfinished_requests():
            for output in EngineCoreOutputs.of_step(engine.step()).outputs:
                tokens[output.request_id] += output.new_token_ids
        assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks
        return tokens, engine
    finally:
        engine.shutdown()


def _prompts(vocab: int) -> list[list[int]]:
    return random_prompts([5, 23, 40, 11], vocab, seed=7)


@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 16, "num_kv_blocks": 24}],
                         ids=["roomy", "chunked and preempted"])
def test_greedy_output_equals_no_speculation(mtp_model, engine_args):
    """Its KV follows the target's through prompt chunks, verification and preemption: outputs never change."""
    prompts = _prompts(AutoConfig.from_pretrained(mtp_model).vocab_size)
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)] * len(prompts)
    expected, _ = _run(mtp_model, prompts, params, **engine_args)
    tokens, engine = _run(mtp_model, prompts, params, MTP, **engine_args)
    assert tokens == expected
    assert engine.get_stats().spec_decoding.num_draft_tokens > 0
    if "num_kv_blocks" in engine_args:
        assert engine.get_stats().num_preemptions > 0


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_later_steps_of_a_call_verify_the_layers_drafts(mtp_model, monkeypatch, temperature):
    """Multi-step calls with the layer: a worker call's later steps each verify the drafts it proposed from the step
    before's hidden states (counted in the calls' outputs), the layer's decoder layer runs in the C++ layer each
    time, and greedy output is still the plain engine's."""
    outputs, layer_runs = [], {"all": 0, "fused": 0}
    execute, layer_forward, fused_forward = ModelRunner.execute_model, MtpLayer.forward, MtpStage.fused_forward

    def recording(self, *args, **kwargs):
        outputs.append(execute(self, *args, **kwargs))
        return outputs[-1]

    def counted(name, method):
        def run(*args, **kwargs):
            layer_runs[name] += 1
            return method(*args, **kwargs)
        return run

    monkeypatch.setattr(ModelRunner, "execute_model", recording)
    monkeypatch.setattr(MtpLayer, "forward", counted("all", layer_forward))
    monkeypatch.setattr(MtpStage, "fused_forward", counted("fused", fused_forward))
    prompts = _prompts(AutoConfig.from_pretrained(mtp_model).vocab_size)[:2]
    params = [SamplingParams(max_tokens=24, temperature=temperature, seed=i, ignore_eos=True) for i in range(2)]
    expected, _ = _run(mtp_model, prompts, params, multi_step_budget_ms=None)
    outputs.clear()
    tokens, engine = _run(mtp_model, prompts, params, MTP, multi_step_budget_ms=None)
    verifications = [len(checks) for output in outputs for checks in output.verified.values()]
    assert max(verifications) > 1, verifications
    assert len(outputs) < sum(verifications)
    assert engine.get_stats().spec_decoding.num_drafts == sum(verifications)
    assert layer_runs["fused"] == layer_runs["all"] > 0
    if temperature == 0.0:
        assert tokens == expected


@torch.no_grad()
def _reference_drafts(target, layer, context: list[int], count: int) -> list[int]:
    """The MTP layer over the whole context: row p takes the target's h_p and token p + 1; each further draft
    appends the layer's own last output and the draft before it."""
    ids = torch.tensor([context])
    hidden = target.model(ids).last_hidden_state[:, :-1]
    next_ids, drafts = ids[:, 1:], []
    for _ in range(count):
        out = layer(next_ids, hidden)
        drafts.append(int(layer.logits(out[:, -1]).argmax()))
        next_ids = torch.cat([next_ids, torch.tensor([[drafts[-1]]])], 1)
        hidden = torch.cat([hidden, out[:, -1:]], 1)
    return drafts


@pytest.mark.parametrize("cutoff, max_tokens", [(None, (12, 12, 12, 12)), (1, (4, 6, 8, 30))],
                         ids=["always", "once alone"])
def test_drafts_equal_the_reference_layer_over_the_whole_context(mtp_model, monkeypatch, cutoff, max_tokens):
    """Every draft the engine proposed (greedy, prompts in chunks, several requests a step) is what transformers'
    decoder layer with the same weights proposes over the request's whole context at once; also where drafts start
    once a request runs alone (disable_by_batch_size 1): the layer read every step's hidden states before. The
    Python steps' drafts (test_multi_step.py shows a call's C++ steps draft the same)."""
    proposed: list[tuple[list[int], list[int]]] = []
    propose = MtpProposer.propose
    monkeypatch.setattr(MtpProposer, "kernel_drafts", lambda self, states, contexts, capacity: None)

    def recording(self, states, new_tokens):
        drafts = propose(self, states, new_tokens)
        proposed.extend((state.token_ids + tokens, draft) for state, tokens, draft in zip(states, new_tokens, drafts))
        return drafts

    monkeypatch.setattr(MtpProposer, "propose", recording)
    config = AutoConfig.from_pretrained(mtp_model)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    _run(mtp_model, _prompts(config.vocab_size), params, {**MTP, "disable_by_batch_size": cutoff},
         max_num_batched_tokens=24, enable_prefix_caching=False)
    target = AutoModelForCausalLM.from_pretrained(mtp_model, dtype=torch.float32).eval()
    layer = load_mtp_layer(mtp_model, config).eval()
    assert len(proposed) > 8 and all(len(drafts) == MTP["num_speculative_tokens"] for _, drafts in proposed)
    for context, drafts in proposed:
        assert drafts == _reference_drafts(target, layer, context, len(drafts)), context


def test_sampled_drafts_carry_the_distribution_they_were_drawn_from(mtp_model, monkeypatch):
    """Verification keeps a sampled draft d with probability min(1, p(d) / q(d)): q must be the layer's own
    distribution at each draft, temperature applied, which the reference computes over the whole context."""
    recorded: list[tuple[list[int], list[int], torch.Tensor]] = []
    propose = MtpProposer.propose

    def recording(self, states, new_tokens):
        drafts = propose(self, states, new_tokens)
        recorded.extend((state.token_ids + tokens, draft, self.probs[state.req_id].clone())
                        for state, tokens, draft in zip(states, new_tokens, drafts) if draft)
        return drafts

    monkeypatch.setattr(MtpProposer, "propose", recording)
    config = AutoConfig.from_pretrained(mtp_model)
    temperature = 0.8
    params = [SamplingParams(max_tokens=8, temperature=temperature, seed=i, ignore_eos=True) for i in range(2)]
    _run(mtp_model, _prompts(config.vocab_size)[:2], params, MTP, enable_prefix_caching=False)
    target = AutoModelForCausalLM.from_pretrained(mtp_model, dtype=torch.float32).eval()
    layer = load_mtp_layer(mtp_model, config).eval()
    assert len(recorded) >= 4
    with torch.no_grad():
        for context, drafts, probs in recorded:
            ids = torch.tensor([context])
            hidden, next_ids = target.model(ids).last_hidden_state[:, :-1], ids[:, 1:]
            for position, draft in enumerate(drafts):
                out = layer(next_ids, hidden)
                expected = torch.softmax(layer.logits(out[0, -1]).float() / temperature, dim=-1)
                torch.testing.assert_close(probs[position], expected, atol=1e-5, rtol=1e-4)
                next_ids = torch.cat([next_ids, torch.tensor([[draft]])], 1)
                hidden = torch.cat([hidden, out[:, -1:]], 1)


def test_seeded_sampled_requests_repeat(mtp_model):
    config = AutoConfig.from_pretrained(mtp_model)
    params = [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=i, ignore_eos=True) for i in range(4)]
    first, engine = _run(mtp_model, _prompts(config.vocab_size), params, MTP)
    second, _ = _run(mtp_model, _prompts(config.vocab_size), params, MTP)
    assert first == second
    assert engine.get_stats().spec_decoding.num_draft_tokens > 0


@pytest.mark.parametrize("model, spec, message", [
    ("llama", MTP, "multi-token-prediction layer"),
    ("deepseek_v3", MTP, "lacks weights"),
    ("deepseek_v3", {**MTP, "model": "x"}, "required by method 'draft_model' and only by it"),
])
def test_mtp_is_refused_where_there_is_no_layer(model, spec, message):
    with pytest.raises(ValueError, match=message):
        EngineCore(EngineConfig(model=tiny_model(model), speculative_config=spec, **ENGINE))


def test_a_trained_export_loads_and_serves_with_its_layer(tmp_path):
    """launch/train_mtp.py's export (transformers' save_pretrained in bf16, the layer beside it) loads in the engine;
    the layer drafts and greedy output is the plain engine's."""
    from launch.train_mtp import train

    record = train(tmp_path, steps=2, log_every=1, max_files=4)
    assert all(math.isfinite(entry["loss"]) and math.isfinite(entry["mtp_loss"]) for entry in record["log"])
    prompts = _prompts(AutoConfig.from_pretrained(tmp_path).vocab_size)[:2]
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * 2
    expected, _ = _run(str(tmp_path), prompts, params, dtype="bfloat16")
    tokens, engine = _run(str(tmp_path), prompts, params, MTP, dtype="bfloat16")
    assert tokens == expected and engine.get_stats().spec_decoding.num_draft_tokens > 0
