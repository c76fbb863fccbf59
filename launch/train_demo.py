"""Train the demo model (or its draft) on the stdlib corpus: seeded, resumable from checkpoints, exported as bf16.

    python -m launch.train_demo --model demo   # then --model draft; see the README for the recorded run
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from kernels.cpu_features import cpu_has_native_bf16
from launch.demo_corpus import SourceFile, split, stdlib_files
from launch.demo_skills import skill_documents
from launch.demo_tokens import batch_at, held_out_windows, token_stream, training_documents
from launch.make_model import quiet_transformers
from launch.make_tokenizer import CHAT_TEMPLATE, IM_END, bpe_tokenizer, hf_tokenizer
from launch.model_shapes import ENDOFTEXT_ID, ROPE_PARAMETERS
from launch.shipped import WEIGHTS_DIR

HELD_OUT_FRACTION = 0.02
TOKENIZER_VOCAB = 4096
# Qwen2's pattern without the newlines it glues to punctuation: there "):\n" is one token and "):" is another, so
# a prompt ending "def f(n):" asks for a continuation the model never saw and it writes noise. Here a newline is
# always its own token and a prompt may end anywhere a line does.
CODE_PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s*[\r\n]+"
                          r"|\s+(?!\S)|\s+")
TOKENIZER_KEY = hashlib.sha256(f"{TOKENIZER_VOCAB} {CODE_PRETOKENIZE_REGEX}".encode()).hexdigest()[:8]


@dataclass(frozen=True)
class Recipe:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    context: int  # trained sequence length, and the served max_model_len
    batch: int  # sequences per step
    steps: int
    lr: float
    warmup: int
    skills: int = 0  # generated conversations (launch.demo_skills) filling half of each batch; 0: pretraining


RECIPES = {
    "demo": Recipe(hidden=192, layers=4, heads=6, kv_heads=3, intermediate=576, context=512, batch=16, steps=2400,
                   lr=2e-3, warmup=150),
    # the demo model fine-tuned from its pretrained export (--init-from) to end JSON objects and make one tool call
    "demo-skills": Recipe(hidden=192, layers=4, heads=6, kv_heads=3, intermediate=576, context=512, batch=16,
                          steps=400, lr=5e-4, warmup=20, skills=8000),
    "draft": Recipe(hidden=64, layers=2, heads=2, kv_heads=1, intermediate=192, context=512, batch=16, steps=1200,
                    lr=3e-3, warmup=100),
}


def default_checkpoint_dir(name: str) -> Path:
    cache = os.environ.get("PAGEDSERVE_CACHE") or Path.home() / ".cache" / "pagedserve"
    return Path(cache).expanduser() / "train-demo" / name


# -- data -----------------------------------------------------------------------------------------------------------
def make_tokenizer(train_files: list[SourceFile]) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the training split alone, with the ChatML template."""
    return hf_tokenizer(bpe_tokenizer(TOKENIZER_VOCAB, (f.text for f in train_files), CODE_PRETOKENIZE_REGEX))


# -- model and training ---------------------------------------------------------------------------------------------
def model_config(recipe: Recipe, vocab_size: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab_size, hidden_size=recipe.hidden, num_hidden_layers=recipe.layers,
                       num_attention_heads=recipe.heads, num_key_value_heads=recipe.kv_heads,
                       intermediate_size=recipe.intermediate, max_position_embeddings=recipe.context,
                       rope_parameters=dict(ROPE_PARAMETERS), tie_word_embeddings=True, initializer_range=0.02,
                       bos_token_id=ENDOFTEXT_ID, eos_token_id=ENDOFTEXT_ID, pad_token_id=ENDOFTEXT_ID,
                       dtype="float32")


def learning_rate(recipe: Recipe, step: int) -> float:
    """Linear warm-up, then cosine decay to zero at the last step."""
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    progress = (step - recipe.warmup) / max(1, recipe.steps - recipe.warmup)
    return recipe.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def loss_of(model: LlamaForCausalLM, windows: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())


@torch.no_grad()
def held_out_loss(model: LlamaForCausalLM, windows: torch.Tensor, autocast: bool) -> float:
    model.eval()
    losses = [loss_of(model, windows[i:i + 8], autocast).item() * len(windows[i:i + 8])
              for i in range(0, len(windows), 8)]
    model.train()
    return sum(losses) / len(windows)


class Trainer:
    """One model's run: its data, model, optimizer and step, saved to and resumed from a checkpoint."""

    def __init__(self, name: str, recipe: Recipe, checkpoint_dir: Path, seed: int, files: list[SourceFile],
                 compile_model: bool = False, init_from: Path | None = None) -> None:
        self.name, self.recipe, self.seed, self.checkpoint_dir = name, recipe, seed, checkpoint_dir
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        train_files, held_files = split(files, HELD_OUT_FRACTION, seed)
        if not held_files:
            raise SystemExit(f"no held-out file among {len(files)}: use more files")
        self.init_from = init_from
        self.tokenizer = (PreTrainedTokenizerFast.from_pretrained(init_from) if init_from
                          else self._tokenizer(train_files))
        bpe = self.tokenizer.backend_tokenizer
        self.train_stream = token_stream(bpe, training_documents(train_files))
        self.skills_stream = (token_stream(bpe, skill_documents(self._render, recipe.skills, seed))
                              if recipe.skills else None)
        self.held_out = held_out_windows(token_stream(bpe, [f.text for f in held_files]), recipe.context, 64)
        self.autocast = cpu_has_native_bf16()
        torch.manual_seed(seed)
        with quiet_transformers():
            self.model = (LlamaForCausalLM.from_pretrained(init_from, dtype=torch.float32) if init_from
                          else LlamaForCausalLM(model_config(recipe, len(self.tokenizer))))
        # torch.compile fuses the norms, softmax and loss: ~20% faster steps on CPU (the engine's eval stays eager)
        self.train_forward = torch.compile(self.model) if compile_model else self.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.1)
        self.step, self.seconds, self.log = 0, 0.0, []
        self._resume()

    def _render(self, messages: list[dict], tools: list[dict] | None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=CHAT_TEMPLATE)

    def batch(self, step: int) -> torch.Tensor:
        """Step `step`'s windows: all from the training stream, or half of them from the generated skills."""
        recipe = self.recipe
        if self.skills_stream is None:
            return batch_at(self.train_stream, step, recipe.batch, recipe.context, self.seed)
        half = recipe.batch // 2
        return torch.cat([batch_at(self.train_stream, step, recipe.batch - half, recipe.context, self.seed),
                          batch_at(self.skills_stream, step, half, recipe.context, self.seed + 1)])

    def _tokenizer(self, train_files: list[SourceFile]) -> PreTrainedTokenizerFast:
        """The shared tokenizer: trained once, kept beside the checkpoints, reused by the draft."""
        folder = self.checkpoint_dir.parent / f"tokenizer-seed{self.seed}-{TOKENIZER_KEY}"
        if not (folder / "tokenizer.json").exists():
            make_tokenizer(train_files).save_pretrained(folder, save_jinja_files=False)
        return PreTrainedTokenizerFast.from_pretrained(folder)

    @property
    def _checkpoint_path(self) -> Path:
        return self.checkpoint_dir / "checkpoint.safetensors"

    def _resume(self) -> None:
        path = self._checkpoint_path
        if not path.exists():
            return
        with safe_open(path, "pt") as checkpoint:
            meta = json.loads(checkpoint.metadata()["trainer"])
            tensors = {key: checkpoint.get_tensor(key) for key in checkpoint.keys()}
        if meta["recipe"] != asdict(self.recipe) or meta["seed"] != self.seed or meta.get("tokenizer") != TOKENIZER_KEY:
            raise SystemExit(f"{path} is from another recipe, seed or tokenizer; remove it to start over")
        with torch.no_grad():
            for name, parameter in self.model.named_parameters():
                parameter.copy_(tensors[f"model.{name}"])
        state = {int(index): {key: tensors[f"optimizer.{index}.{key}"] for key in keys}
                 for index, keys in meta["optimizer_state_keys"].items()}
        self.optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
        self.step, self.seconds, self.log = meta["step"], meta["seconds"], meta["log"]
        print(f"resumed {self.name} at step {self.step} ({self.seconds / 60:.1f} min trained)", flush=True)

    def save_checkpoint(self) -> None:
        """Weights and optimizer moments as safetensors, the rest as JSON metadata: no pickle in a checkpoint."""
        optimizer = self.optimizer.state_dict()
        tensors = {f"model.{name}": p.detach() for name, p in self.model.named_parameters()}  # tied weights once
        tensors |= {f"optimizer.{index}.{key}": value for index, state in optimizer["state"].items()
                    for key, value in state.items()}
        meta = {"recipe": asdict(self.recipe), "seed": self.seed, "tokenizer": TOKENIZER_KEY, "step": self.step,
                "seconds": self.seconds, "log": self.log, "param_groups": optimizer["param_groups"],
                "optimizer_state_keys": {index: list(state) for index, state in optimizer["state"].items()}}
        temporary = self._checkpoint_path.with_suffix(".tmp")
        save_file({key: value.contiguous() for key, value in tensors.items()}, temporary,
                  metadata={"trainer": json.dumps(meta)})
        os.replace(temporary, self._checkpoint_path)

    def train(self, checkpoint_every_s: float, eval_every: int, stop_at: int | None = None) -> None:
        """Train to the recipe's last step (or to `stop_at`, leaving a checkpoint to resume from)."""
        recipe, last_save = self.recipe, time.monotonic()
        last = min(recipe.steps, stop_at) if stop_at is not None else recipe.steps
        print(f"{self.name}: {sum(p.numel() for p in self.model.parameters()) / 1e6:.2f}M parameters, "
              f"{len(self.train_stream) / 1e6:.2f}M training tokens, {self.held_out.numel() / 1e3:.0f}k held-out "
              f"tokens, bf16 autocast: {self.autocast}", flush=True)
        self.model.train()
        while self.step < last:
            start = time.monotonic()
            for group in self.optimizer.param_groups:
                group["lr"] = learning_rate(recipe, self.step)
            loss = loss_of(self.train_forward, self.batch(self.step), self.autocast)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.step += 1
            self.seconds += time.monotonic() - start
            if self.step % eval_every == 0 or self.step == recipe.steps:
                self._record(loss.item())
            if time.monotonic() - last_save >= checkpoint_every_s:
                self.save_checkpoint()
                last_save = time.monotonic()
        self.save_checkpoint()

    def _record(self, train_loss: float) -> None:
        held = held_out_loss(self.model, self.held_out, self.autocast)
        tokens = self.step * self.recipe.batch * self.recipe.context
        self.log.append({"step": self.step, "minutes": round(self.seconds / 60, 2), "tokens": tokens,
                         "train_loss": round(train_loss, 4), "held_out_loss": round(held, 4)})
        print(f"{self.name} step {self.step}/{self.recipe.steps} {self.seconds / 60:.1f} min {tokens / 1e6:.2f}M tok "
              f"train {train_loss:.3f} held-out {held:.3f} (ppl {math.exp(held):.1f})", flush=True)

    def export(self, out: Path) -> None:
        """The trained model as a HuggingFace folder: bf16 safetensors, tokenizer, chat template, stop tokens."""
        out.mkdir(parents=True, exist_ok=True)
        im_end = self.tokenizer.convert_tokens_to_ids(IM_END)
        self.model.generation_config = GenerationConfig(bos_token_id=ENDOFTEXT_ID, eos_token_id=[ENDOFTEXT_ID, im_end],
                                                        pad_token_id=ENDOFTEXT_ID)
        self.model.config.dtype = torch.bfloat16
        self.model.to(torch.bfloat16).save_pretrained(out)
        self.model.float()
        self.tokenizer.model_max_length = self.recipe.context
        self.tokenizer.chat_template = CHAT_TEMPLATE  # today's, not that of a tokenizer cached by an older run
        self.tokenizer.save_pretrained(out, save_jinja_files=False)
        record = {"recipe": asdict(self.recipe), "seed": self.seed, "log": self.log}
        if self.init_from is not None and (self.init_from / "training_log.json").exists():
            record["pretraining"] = json.loads((self.init_from / "training_log.json").read_text())
        (out / "training_log.json").write_text(json.dumps(record, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.train_demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=tuple(RECIPES), default="demo")
    parser.add_argument("--steps", type=int, help="train this many steps instead of the recipe's (the cosine "
                        "schedule spans them)")
    parser.add_argument("--out", type=Path, help="export folder (default: the shipped launch/demo/<model>)")
    parser.add_argument("--checkpoint-dir", type=Path, help="default: ~/.cache/pagedserve/train-demo/<model>")
    parser.add_argument("--checkpoint-minutes", type=float, default=10.0)
    parser.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations")
    parser.add_argument("--stop-at-step", type=int, help="checkpoint and exit at this step (resume later)")
    parser.add_argument("--init-from", type=Path, help="an exported model folder to start from (demo-skills: the "
                        "pretrained demo's export)")
    parser.add_argument("--max-files", type=int, help="train on the first N stdlib files only (a smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.compile the training forward (a minute to compile, then faster steps)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    recipe = RECIPES[args.model]
    if args.steps is not None:
        warmup = min(recipe.warmup, max(1, args.steps // 10))
        recipe = Recipe(**{**asdict(recipe), "steps": args.steps, "warmup": warmup})
    checkpoint_dir = args.checkpoint_dir or default_checkpoint_dir(args.model)
    if recipe.skills and args.init_from is None:
        raise SystemExit(f"--model {args.model} fine-tunes an export: give it --init-from FOLDER")
    trainer = Trainer(args.model, recipe, checkpoint_dir, args.seed, stdlib_files(args.max_files), args.compile,
                      args.init_from)
    trainer.train(args.checkpoint_minutes * 60, min(args.eval_every, recipe.steps), args.stop_at_step)
    if trainer.step < recipe.steps:
        print(f"stopped at step {trainer.step} of {recipe.steps}: run again to resume")
        return 0
    out = args.out or WEIGHTS_DIR / args.model.removesuffix("-skills")
    trainer.export(out)
    print(f"exported {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
