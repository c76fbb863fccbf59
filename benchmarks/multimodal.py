"""LLaVA-1.5's image path: images per second through the vision encoder, and time to first token with the encoder cache.

The model: LLaVA-1.5's layout (a CLIP ViT read at its second-to-last layer, the default select strategy, the
two-layer GELU projector) with a smaller, documented tower, CLIP ViT-B/16 at 224 px (openai/clip-vit-base-patch16:
width 768, 12 layers, 12 heads, MLP 3072, 196 patches; LLaVA-1.5's ViT-L/14-336 is 300M parameters, too big for a
2-core CPU in seconds), random weights, and a language model of the model maker's 30m shape (width 512, 8 layers) on
the tiny LLaVA's tokenizer.
(a) `encode_images` (tower and projector) on a batch of images, in this process: images per second, the median of
    --repeats after one untimed call, and the GFLOP/s of the tower's products, from which ViT-L/14-336's rate on the
    same machine is estimated (its products counted the same way).
(b) Time to first token offline (`LLM.generate` with max_tokens 1, engine-core process): an image the encoder cache
    holds (seen before, the prompt's text different from its first token on, so the prefix cache serves nothing)
    against a new image, alternated, --repeats each, medians. Images are processed before the clock starts, so both
    measure the engine alone: the encoder's cost is the difference.

    python benchmarks/multimodal.py [--repeats 7] [--batch 8] [--note "a quiet machine"] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import LlavaConfig, LlavaForConditionalGeneration

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from frontend import LLM, SamplingParams  # noqa: E402
from kernels.cpu_features import cpu_flags, cpu_has_native_bf16  # noqa: E402
from launch.make_model import quiet_transformers  # noqa: E402
from launch.make_vision_model import make_llava  # noqa: E402
from workers.model_config import load_hf_config  # noqa: E402
from workers.model_loader import load_model  # noqa: E402

VIT_B_16 = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
            "image_size": 224, "patch_size": 16, "hidden_act": "quick_gelu", "projection_dim": 512}
VIT_L_14_336 = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "image_size": 336,
                "patch_size": 14}
TEXT_30M = {"hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8, "num_attention_heads": 8,
            "num_key_value_heads": 4, "head_dim": 64}


def write_model(folder: Path, tiny: Path) -> Path:
    """The benchmark's LLaVA-1.5 folder: the tiny LLaVA's tokenizer and processor files, ViT-B/16 and a 30m text
    model, random weights."""
    for name in os.listdir(tiny):
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(tiny / name, folder / name)
    config = LlavaConfig.from_pretrained(tiny)
    config.vision_config.update(VIT_B_16)
    config.text_config.update(TEXT_30M)
    config.image_seq_length = (VIT_B_16["image_size"] // VIT_B_16["patch_size"]) ** 2
    with quiet_transformers(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlavaForConditionalGeneration(config).save_pretrained(folder)
    side = VIT_B_16["image_size"]
    sizes = {"crop_size": {"height": side, "width": side}, "size": {"shortest_edge": side}}
    preprocessor = json.loads((folder / "preprocessor_config.json").read_text()) | sizes
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    processor = json.loads((folder / "processor_config.json").read_text())
    processor |= {"image_processor": processor["image_processor"] | sizes, "patch_size": VIT_B_16["patch_size"]}
    (folder / "processor_config.json").write_text(json.dumps(processor))
    return folder


def tower_flops(hidden: int, mlp: int, layers: int, image_size: int, patch: int) -> float:
    """The products of one image through `layers` CLIP layers: 2 x multiply-adds of the projections, the MLP and
    attention's scores and sums (the patch embedding and norms left out)."""
    tokens = (image_size // patch) ** 2 + 1
    return 2.0 * layers * (tokens * (4 * hidden * hidden + 2 * hidden * mlp) + 2 * tokens * tokens * hidden)


def timed(work: Callable[[], object], repeats: int) -> list[float]:
    """Seconds each of `repeats` calls of `work` took, after one untimed call."""
    work()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - start)
    return seconds


def encoder_rate(folder: Path, batch: int, repeats: int) -> list[str]:
    config = load_hf_config(str(folder))
    model = load_model(str(folder), config, torch.float32, torch.device("cpu"))
    side, run = VIT_B_16["image_size"], len(model.vision_tower.encoder.layers)
    pixels = torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        median = statistics.median(timed(lambda: model.encode_images(pixels), repeats))
    flops = tower_flops(768, 3072, run, side, VIT_B_16["patch_size"])
    large = tower_flops(1024, 4096, VIT_L_14_336["num_hidden_layers"] - 1, 336, 14)  # read at layer -2
    rate = batch / median
    return [f"encoder, ViT-B/16-224 ({run} of 12 layers run) + projector, batch {batch}, {torch.get_num_threads()} "
            f"threads: {rate:7.2f} images/s "
            f"({median * 1e3:.0f} ms a batch; tower {rate * flops / 1e9:.1f} GFLOP/s)",
            f"  ViT-L/14-336 ({large / flops:.1f}x the products) at the same GFLOP/s: ~{rate * flops / large:.2f} "
            "images/s"]


def picture(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (240, 320, 3), dtype=np.uint8))


def first_token_times(folder: Path, repeats: int) -> list[str]:
    llm = LLM(str(folder), dtype="float32", max_model_len=1024)
    try:
        one = SamplingParams(temperature=0.0, max_tokens=1)
        processed = [llm.router.image_processor.process([picture(seed)]) for seed in range(repeats + 2)]

        def ask(number: int, images: list) -> float:
            prompt = {"prompt": f"Question {number}: what is in <image>?", "multi_modal_data": {"image": images}}
            start = time.perf_counter()
            [output] = llm.generate(prompt, one, use_tqdm=False)
            assert output.num_cached_tokens == 0, "the prefix cache served a block: the texts must differ"
            return time.perf_counter() - start

        ask(0, processed[0])  # warms the engine; image 0 stays in the encoder cache
        cold, warm = [], []
        for number in range(1, repeats + 1):
            cold.append(ask(2 * number, processed[number]))
            warm.append(ask(2 * number + 1, processed[0]))
        features = llm.info.image_feature_count
    finally:
        llm.shutdown()
    cold_ms, warm_ms = statistics.median(cold) * 1e3, statistics.median(warm) * 1e3
    return [f"time to first token, {features} image features + ~12 text tokens, median of {repeats}:",
            f"  new image (encoder runs)      {cold_ms:8.1f} ms",
            f"  image in the encoder cache    {warm_ms:8.1f} ms  ({cold_ms / warm_ms:.2f}x faster)"]


def machine(note: str, dtype: str = "float32") -> str:
    model = next((line.partition(":")[2].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "an unknown CPU")
    flags = cpu_flags()
    sets = ", ".join(name for name, flag in (("AVX2", "avx2"), ("FMA", "fma"), ("AVX-512", "avx512f"))
                     if flag in flags) or "no AVX"
    return f"{os.cpu_count()} CPUs ({model}; {sets}; native bf16 {cpu_has_native_bf16()}), " \
        f"torch {torch.__version__}, {dtype}. {note}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=8, help="images in one encode_images call")
    parser.add_argument("--note", default="A machine shared with other work while it ran: indicative figures only.")
    parser.add_argument("--out", type=Path, help="the markdown result (default: benchmarks/results/"
                                                 "multimodal-cpu-DATE.md)")
    args = parser.parse_args()
    today = datetime.date.today().isoformat()
    out = args.out or ROOT / "benchmarks" / "results" / f"multimodal-cpu-{today}.md"
    tiny = make_llava(Path(tempfile.gettempdir()) / "pagedserve-llava-tiny")  # reused when made before
    with tempfile.TemporaryDirectory() as temp:
        folder = write_model(Path(temp), tiny)
        lines = encoder_rate(folder, args.batch, args.repeats) + first_token_times(folder, args.repeats)
    print("\n".join(lines))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    command = f"`python benchmarks/multimodal.py --repeats {args.repeats} --batch {args.batch}` on {machine(args.note)}"
    out.write_text(f"# benchmarks/multimodal.py, {today}, at {commit}\n\n{textwrap.fill(command, 120)}\n\n```\n"
                   + "\n".join(lines) + "\n```\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
