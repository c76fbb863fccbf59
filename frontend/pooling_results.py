"""Pooled vectors as users see them: embeddings, class probabilities, similarity and cross-encoder scores."""
from __future__ import annotations

import numpy as np


def vector(pooled: bytes) -> np.ndarray:
    return np.frombuffer(pooled, dtype="<f4")


def probabilities(logits: bytes) -> list[float]:
    """Softmax over a classifier's labels; the sigmoid of a one-label model's logit."""
    values = vector(logits).astype(np.float64)
    if len(values) == 1:
        return [float(1 / (1 + np.exp(-values[0])))]
    exp = np.exp(values - values.max())
    return (exp / exp.sum()).tolist()


def cosine(a: bytes, b: bytes) -> float:
    x, y = vector(a).astype(np.float64), vector(b).astype(np.float64)
    norms = np.linalg.norm(x) * np.linalg.norm(y)
    return float(x @ y / norms) if norms else 0.0
