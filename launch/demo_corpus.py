"""The demo model's corpus: the running Python's standard-library sources, split by whole file, plus chat examples."""
from __future__ import annotations

import ast
import hashlib
import itertools
import os
import sysconfig
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SKIPPED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})
MAX_CHAT_FUNCTION_CHARS = 1500  # longer functions make poor chat answers for a model with a short context


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the stdlib folder: the same on every machine with this Python
    text: str


def stdlib_sources() -> Iterator[Path]:
    """The stdlib's .py files (no tests, no installed packages), in a fixed order."""
    for dirpath, dirnames, filenames in os.walk(sysconfig.get_paths()["stdlib"]):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_STDLIB_DIRS)
        yield from (Path(dirpath, name) for name in sorted(filenames) if name.endswith(".py"))


def stdlib_files(limit: int | None = None) -> list[SourceFile]:
    """The stdlib's .py files (the first `limit` of them), read."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [SourceFile(str(path.relative_to(root)), path.read_text(encoding="utf-8", errors="replace"))
            for path in itertools.islice(stdlib_sources(), limit)]


def is_held_out(file: SourceFile, fraction: float, seed: int) -> bool:
    """Whether a whole file belongs to the held-out split: a stable hash of its path and the seed, never its
    position, so adding a file to the stdlib moves no other file between splits."""
    digest = hashlib.sha256(f"{seed}:{file.path}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < fraction * 2**64


def split(files: list[SourceFile], fraction: float, seed: int) -> tuple[list[SourceFile], list[SourceFile]]:
    """(training files, held-out files)."""
    held_out = [f for f in files if is_held_out(f, fraction, seed)]
    names = {f.path for f in held_out}
    return [f for f in files if f.path not in names], held_out


def chat_pairs(file: SourceFile) -> Iterator[tuple[str, str]]:
    """(question, answer) pairs from a file's documented functions: "write `name(signature)`: <first docstring
    line>" answered by the function's source."""
    try:
        tree = ast.parse(file.text)
    except (SyntaxError, ValueError):  # a few stdlib files are templates or Python 2
        return
    lines = file.text.splitlines(keepends=True)  # once: ast.get_source_segment splits the file on every call
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name.startswith("_"):
            continue
        docstring = ast.get_docstring(node)
        source = "".join(lines[node.lineno - 1:node.end_lineno])  # whole lines, from `def` (no decorators)
        if not docstring or len(source) > MAX_CHAT_FUNCTION_CHARS:
            continue
        summary = docstring.strip().splitlines()[0].strip()
        yield (f"Write a Python function `{node.name}({ast.unparse(node.args)})`: {summary}",
               textwrap.dedent(source).rstrip("\n"))
