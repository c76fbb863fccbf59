"""AutoRound test checkpoints: a tiny model quantized by the auto-round package itself (RTN, no calibration data),
and a float32 reference folder whose quantized weights auto-round's own code dequantized from the saved tensors."""
from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import torch
from safetensors import safe_open

from quantized_checkpoints import copy_tokenizer, fresh_folder, hf_model, save_plain

SPEC_FILE = "autoround-spec.json"
PACKED_TENSORS = ("qweight", "qzeros", "scales", "g_idx")


def autoround_checkpoint(source: str, folder: Path, spec: dict) -> tuple[str, str]:
    """(quantized folder, reference folder) for `spec` (format, bits, group_size, sym, layer_config), made once:
    an existing pair made from the same spec is reused."""
    quantized, reference = folder / "quantized", folder / "reference"
    marker = folder / SPEC_FILE
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return str(quantized), str(reference)
    fresh_folder(folder)
    _quantize(source, quantized, spec)
    _save_reference(source, quantized, reference)
    marker.write_text(json.dumps(spec))
    return str(quantized), str(reference)


def _quantize(source: str, out: Path, spec: dict) -> None:
    from auto_round import AutoRound
    from transformers import AutoTokenizer

    logging.getLogger("autoround").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    autoround = AutoRound(hf_model(source), AutoTokenizer.from_pretrained(source), bits=spec["bits"],
                          group_size=spec["group_size"], sym=spec["sym"], layer_config=spec.get("layer_config"),
                          iters=0, disable_opt_rtn=True, device_map="cpu")
    # quantize_and_save (auto-round's streaming path: save_quantized after quantize fails for AWQ) writes into a
    # folder of its own naming under the one it is given.
    written = out.with_name("autoround-output")
    autoround.quantize_and_save(str(written), format=spec["format"])
    next(written.glob("*/config.json")).parent.rename(out)
    written.rmdir()


def _save_reference(source: str, quantized: Path, reference: Path) -> None:
    """The source model with each quantized linear's weight replaced by what auto-round's code dequantizes from the
    saved tensors (bits and group size read off the tensors' shapes, not the config)."""
    config = json.loads((quantized / "config.json").read_text())["quantization_config"]
    model = hf_model(source)
    with torch.no_grad():
        for name, module in model.named_modules():
            tensors = _module_tensors(quantized, name)
            if tensors:
                module.weight.copy_(_dequantize(config, tensors, module.in_features, module.out_features))
    save_plain(model, reference)
    copy_tokenizer(source, reference)


def _module_tensors(folder: Path, module: str) -> dict[str, torch.Tensor]:
    found = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as reader:
            found.update({key[len(module) + 1:]: reader.get_tensor(key) for key in reader.keys()
                          if key.rpartition(".")[0] == module and key.endswith(PACKED_TENSORS)})
    return found


def _dequantize(config: dict, tensors: dict[str, torch.Tensor], in_features: int, out_features: int) -> torch.Tensor:
    """The float32 weight [out, in] of one module, by auto-round's own unpacking for the packing the config names."""
    scales = tensors["scales"].float()
    group_size = in_features // scales.shape[0]
    packing = config.get("packing_format") or config["quant_method"]
    if "awq" in packing:
        from auto_round.export.export_to_awq.utils import dequantize_gemm

        return dequantize_gemm(tensors["qweight"], tensors["qzeros"], scales, 4, group_size).t()
    bits = tensors["qweight"].shape[0] * 32 // in_features
    if packing in ("auto_round:auto_gptq", "gptq"):  # zero points stored minus one
        from auto_round_extension.torch.qlinear_torch_zp import QuantLinear
    else:
        from auto_round_extension.torch.qlinear_torch import QuantLinear
    # auto-round writes g_idx without act-order (k // group_size); its g_idx product only fits square weights, so
    # the uniform groups serve.
    g_idx = tensors.pop("g_idx", None)
    assert g_idx is None or torch.equal(g_idx.long(), torch.arange(in_features) // group_size)
    layer = QuantLinear(bits, group_size, in_features, out_features, False)
    for key, tensor in tensors.items():
        setattr(layer, key, scales if key == "scales" else tensor)
    return layer(torch.eye(in_features)).t()


# The kinds the tests load: auto-round's own packings (its default for symmetric and asymmetric weights, GPTQModel's
# with g_idx), per-layer overrides, and the GPTQ and AWQ folders it writes for the existing loaders.
MIXED_LAYERS = {"model.layers.0.mlp.down_proj": {"bits": 8, "sym": True},
                "model.layers.1.self_attn.o_proj": {"bits": 16}}
AUTOROUND_SPECS = {
    "w4-sym-mixed": dict(format="auto_round", bits=4, group_size=16, sym=True, layer_config=MIXED_LAYERS),
    "w4-asym": dict(format="auto_round", bits=4, group_size=32, sym=False),
    "w8-sym-per-row": dict(format="auto_round", bits=8, group_size=-1, sym=True),
    "w4-asym-gptqmodel": dict(format="auto_round:gptqmodel", bits=4, group_size=16, sym=False),
    "gptq-export-mixed": dict(format="auto_gptq", bits=4, group_size=16, sym=False, layer_config=MIXED_LAYERS),
    "awq-export": dict(format="auto_awq", bits=4, group_size=16, sym=False),
}


def hf_autoround_model(quantized: str):
    """HF transformers' model of the quantized folder itself (AutoRoundConfig: auto-round's QuantLinear modules) in
    float32: auto-round casts the model to float16 on CPU, so its scales (stored float16) are widened back and the
    plain tensors (stored float32) reloaded as stored."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    warnings.filterwarnings("ignore")
    model = torch.nn.Module.float(AutoModelForCausalLM.from_pretrained(quantized, device_map="cpu"))
    stored = {}
    for file in Path(quantized).glob("*.safetensors"):
        stored.update(load_file(str(file)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(stored[name])
    return model.eval()
