"""The trained demo model and its draft, committed under launch/weights/ so `python -m launch` serves at once."""
from __future__ import annotations

from pathlib import Path

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
DEMO_MODEL_NAME = "pagedserve-demo"  # the demo model's id for clients, instead of its folder
# The kind of question the demo model was trained to answer (launch/demo_corpus.py's chat pairs).
DEMO_CHAT_PROMPT = "Write a Python function `fibonacci(n)`: Return the n-th Fibonacci number."


def shipped_model(name: str = "demo") -> Path:
    """The folder of the shipped `demo` model or its `draft`; a clear error if its weights are missing."""
    folder = WEIGHTS_DIR / name
    if not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(f"{folder} holds no trained weights: train them with "
                                f"`python -m launch.train_demo --model {name}` (see the README's demo model section)")
    return folder
