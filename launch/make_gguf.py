"""HF model folder → GGUF file with llama.cpp's own tools: its converter (convert_hf_to_gguf.py) writes F32/F16/BF16
or Q8_0, its `llama-quantize` any other type (Q4_K_M, ...). Needs a llama.cpp checkout with `llama-quantize` built
(README: "GGUF files"); LLAMA_CPP_DIR names it.

    python -m launch.make_gguf --model FOLDER --out model-q4_k_m.gguf --type Q4_K_M
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")
LLAMA_CPP_ENV = "LLAMA_CPP_DIR"
# The converter refuses a BPE pre-tokenizer it has no hash for (the model maker's is llama-bpe's pattern) and tries
# sentencepiece first for llama; the engine reads only the tensors (the tokenizer comes from the HF folder).
_CONVERT = """
import runpy, sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "llama-bpe"
def no_sentencepiece(self):
    raise FileNotFoundError("a BPE tokenizer.json model")
base.TextModel._set_vocab_sentencepiece = no_sentencepiece
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(root + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def llama_cpp_dir() -> Path | None:
    """The llama.cpp checkout named by LLAMA_CPP_DIR, when it has the converter and a built llama-quantize."""
    root = os.environ.get(LLAMA_CPP_ENV)
    if not root:
        return None
    path = Path(root)
    return path if (path / "convert_hf_to_gguf.py").is_file() and quantize_binary(path).is_file() else None


def quantize_binary(root: Path) -> Path:
    return root / "build" / "bin" / "llama-quantize"


def make_gguf(model: Path, out: Path, kind: str, root: Path | None = None) -> Path:
    """Write `model` as a GGUF of `kind` (a converter type or a llama-quantize type) to `out`."""
    root = root or llama_cpp_dir()
    if root is None:
        raise RuntimeError(f"no llama.cpp checkout with a built llama-quantize: set {LLAMA_CPP_ENV}")
    out.parent.mkdir(parents=True, exist_ok=True)
    if kind.lower() in CONVERTER_TYPES:
        _convert(root, model, out, kind.lower())
        return out
    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "f32.gguf"
        _convert(root, model, full, "f32")
        subprocess.run([str(quantize_binary(root)), str(full), str(out), kind], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return out


def _convert(root: Path, model: Path, out: Path, kind: str) -> None:
    subprocess.run([sys.executable, "-c", _CONVERT, str(root), str(model), "--outfile", str(out), "--outtype", kind],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.make_gguf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="HF model folder")
    parser.add_argument("--out", type=Path, required=True, help="GGUF file to write")
    parser.add_argument("--type", default="Q8_0", help="f32, f16, bf16, q8_0, or a llama-quantize type (Q4_K_M...)")
    parser.add_argument("--llama-cpp", type=Path, help=f"llama.cpp checkout (default: ${LLAMA_CPP_ENV})")
    args = parser.parse_args(argv)
    make_gguf(args.model, args.out, args.type, args.llama_cpp)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
