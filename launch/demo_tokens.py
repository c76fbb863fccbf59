"""The demo corpus as the trainer reads it: documents, one token stream, and seeded training windows."""
from __future__ import annotations

import torch
from tokenizers import Tokenizer

from launch.demo_corpus import SourceFile, chat_pairs
from launch.make_tokenizer import IM_END, IM_START
from launch.model_shapes import ENDOFTEXT_ID


def chat_text(question: str, answer: str) -> str:
    return f"{IM_START}user\n{question}{IM_END}\n{IM_START}assistant\n{answer}{IM_END}\n"


def training_documents(files: list[SourceFile]) -> list[str]:
    """Each training file, then the chat examples drawn from the training files."""
    return [f.text for f in files] + [chat_text(q, a) for f in files for q, a in chat_pairs(f)]


def token_stream(tokenizer: Tokenizer, documents: list[str]) -> torch.Tensor:
    """All documents as one int32 stream, each followed by <|endoftext|>."""
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(documents, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(ENDOFTEXT_ID)
    return torch.tensor(ids, dtype=torch.int32)


def batch_at(stream: torch.Tensor, step: int, batch: int, context: int, seed: int) -> torch.Tensor:
    """Step `step`'s windows of context + 1 tokens at seeded random offsets: the same on a resumed run."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(stream) - context - 1, (batch,), generator=generator)
    return torch.stack([stream[s:s + context + 1] for s in starts.tolist()]).long()


def held_out_windows(stream: torch.Tensor, context: int, max_windows: int) -> torch.Tensor:
    """Consecutive windows from the start of the held-out stream (the same every evaluation)."""
    count = min(max_windows, (len(stream) - 1) // context)
    return torch.stack([stream[i * context:i * context + context + 1] for i in range(count)]).long()
