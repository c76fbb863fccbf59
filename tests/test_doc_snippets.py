"""Every fenced code block of README.md and docs/*.md runs (or is checked), so a stale snippet fails the suite.

The word after the fence says what happens to a block:

- `python`: runs as a script in the repository root (PYTHONPATH the repository) and must exit 0.
- `bash`: runs under `bash -euo pipefail` in the repository root and must exit 0.
  In both, `http://127.0.0.1:8000` stands for the module's demo server and `ipc:///tmp/pagedserve-engine` for its
  engine address; the test substitutes the real port and a private address, as a user would edit them.
- `bash server`: each line starts a server (`python -m launch ...`). The README's first one is the module's demo
  server; any other is started alone, polled until /health answers 200, then stopped.
- `bash setup`: one of the set-up commands: the test command `.ci/run` runs verbatim, or the serve command (the
  same install with `.` for `".[test]"`, then `python -m launch`).
- `bash cluster`: commands for several machines; each `--flag` must appear in its command's `--help`.
- `python cuda`: runs where torch sees CUDA, else skipped with that reason.
- `bash long`: takes minutes or the network; runs with PAGEDSERVE_DOC_SNIPPETS_LONG=1, else skipped with that reason.
- `text`: output, listings and diagrams; never run.

Any other word after the fence fails, so a new block has to choose.
"""
from __future__ import annotations

import functools
import itertools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ipc.sockets import private_ipc_address
from launcher import REPO, start_launcher, stop_launcher

DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
KINDS = {"python", "bash", "bash server", "bash setup", "bash cluster", "python cuda", "bash long", "text"}
USER_URL = "http://127.0.0.1:8000"
USER_ENGINE = "ipc:///tmp/pagedserve-engine"
SERVE = "python -m launch"
SNIPPET_TIMEOUT_S = 300
FENCE = re.compile(r"^```(.*)$")


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int
    kind: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    def commands(self) -> list[str]:
        """Its lines without comments and blank lines, continuation lines joined."""
        joined = self.code.replace("\\\n", " ")
        return [line for line in (shlex.join(shlex.split(raw, comments=True)) for raw in joined.splitlines()) if line]


def extract(path: Path) -> list[Snippet]:
    """The fenced blocks of a Markdown file, in order."""
    snippets, lines, index = [], path.read_text().splitlines(), 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        end = next((i for i in range(index + 1, len(lines)) if lines[i].rstrip() == "```"), None)
        assert end is not None, f"{path}:{index + 1}: a fence that never closes"
        snippets.append(Snippet(path, index + 1, " ".join(opening.group(1).split()), "\n".join(lines[index + 1:end])))
        index = end + 1
    return snippets


SNIPPETS = [snippet for path in DOC_FILES for snippet in extract(path)]


def of_kind(*kinds: str) -> list[Snippet]:
    return [snippet for snippet in SNIPPETS if snippet.kind in kinds]


def demo_server_command() -> list[str]:
    """The README's first `bash server` line, the module's demo server, as arguments after `python -m launch`."""
    first = next(s for s in SNIPPETS if s.path.name == "README.md" and s.kind == "bash server").commands()[0]
    assert first.startswith(SERVE), first
    return shlex.split(first)[len(SERVE.split()):]


@pytest.fixture(scope="module")
def demo_server() -> tuple[str, str]:
    """(base URL, engine address) of the README's serve line, on a free port and a private engine address."""
    address = private_ipc_address()
    args = [address if arg == USER_ENGINE else arg for arg in demo_server_command()]
    process, base_url = start_launcher(args)
    yield base_url, address
    assert stop_launcher(process) == 0


def run_snippet(snippet: Snippet, server: tuple[str, str]) -> subprocess.CompletedProcess:
    base_url, address = server
    code = snippet.code.replace(USER_URL, base_url).replace(USER_ENGINE, address)
    argv = [sys.executable, "-c", code] if snippet.kind.startswith("python") else ["bash", "-euo", "pipefail", "-c", code]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S)


def assert_ran(snippet: Snippet, result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, (f"{snippet.name} ({snippet.kind}) exited {result.returncode}:\n{snippet.code}\n"
                                    f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-6000:]}")


def test_every_block_says_what_it_is() -> None:
    unknown = [f"{s.name}: ```{s.kind}" for s in SNIPPETS if s.kind not in KINDS]
    assert not unknown, f"blocks without a known kind ({sorted(KINDS)}): {unknown}"
    assert of_kind("python") and of_kind("bash server"), "the README lost its runnable snippets"


@pytest.mark.parametrize("snippet", of_kind("python", "bash"), ids=lambda s: s.name)
def test_snippet_runs(snippet: Snippet, demo_server: tuple[str, str]) -> None:
    assert_ran(snippet, run_snippet(snippet, demo_server))


@pytest.mark.parametrize("snippet", of_kind("python cuda"), ids=lambda s: s.name)
def test_cuda_snippet_runs(snippet: Snippet, demo_server: tuple[str, str]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    assert_ran(snippet, run_snippet(snippet, demo_server))


@pytest.mark.parametrize("snippet", of_kind("bash long"), ids=lambda s: s.name)
def test_long_snippet_runs(snippet: Snippet, demo_server: tuple[str, str]) -> None:
    if os.environ.get("PAGEDSERVE_DOC_SNIPPETS_LONG") != "1":
        pytest.skip("takes minutes and the package index: set PAGEDSERVE_DOC_SNIPPETS_LONG=1 to run it")
    assert_ran(snippet, run_snippet(snippet, demo_server))


@pytest.mark.parametrize("snippet", of_kind("bash server"), ids=lambda s: s.name)
def test_server_line_serves(snippet: Snippet, demo_server: tuple[str, str]) -> None:
    for command in snippet.commands():
        assert command.startswith(SERVE + " ") or command == SERVE, f"{snippet.name}: not a server: {command}"
        args = shlex.split(command)[len(SERVE.split()):]
        if args == demo_server_command():
            continue  # the module's demo server: already up, its /health answered
        process, _ = start_launcher([demo_server[1] if arg == USER_ENGINE else arg for arg in args])
        assert stop_launcher(process) == 0


def test_setup_commands_are_what_ci_runs() -> None:
    ci = next(line for line in (REPO / ".ci" / "run").read_text().splitlines() if line.startswith("pip install"))
    serve = ci.replace('".[test]"', ".").replace("python -m pytest -q tests", SERVE)
    assert serve != ci and serve.endswith("&& " + SERVE), ci
    blocks = [s.code.strip() for s in of_kind("bash setup")]
    readme = [s.code.strip() for s in of_kind("bash setup") if s.path.name == "README.md"]
    assert readme == [serve, ci], f"the README's set-up commands {readme} are not .ci/run's {ci!r} and its serve twin"
    assert set(blocks) <= {serve, ci}, blocks


@functools.cache
def help_of(program: tuple[str, ...]) -> str:
    """What `program --help` prints; it must exist and succeed."""
    result = subprocess.run([*program, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{' '.join(program)} --help failed: {result.stderr[-2000:]}"
    return result.stdout


@pytest.mark.parametrize("snippet", of_kind("bash cluster"), ids=lambda s: s.name)
def test_cluster_flags_exist(snippet: Snippet) -> None:
    """Commands that need several machines: each subcommand exists and takes the flags the recipe gives it."""
    checked = 0
    for command in snippet.commands():
        words = shlex.split(command)
        if words[0] in ("export", "scp", "mkdir"):
            continue  # the shell's and ssh's, not ours or Ray's
        program = list(itertools.takewhile(lambda w: not w.startswith("-"), words))
        if program[0] == "python":
            program[0] = sys.executable
        help_text = help_of(tuple(program))
        for flag in (w.split("=")[0] for w in words if w.startswith("--")):
            assert flag in help_text, f"{snippet.name}: {' '.join(program)} takes no {flag}"
        checked += 1
    assert checked, f"{snippet.name}: no command checked"
