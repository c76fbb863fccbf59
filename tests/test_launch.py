"""The command line generates text: from a given model folder, and from the built-in demo model."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_launch(args: list[str], env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "launch", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def test_launch_generates_from_a_model_folder(llama_model):
    result = run_launch(["--model", llama_model, "--prompt", "Hello", "--prompt", "Bye", "--max-tokens", "5"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("'Hello' -> '") and lines[1].startswith("'Bye' -> '")


def test_launch_without_model_builds_and_uses_the_demo_model(tmp_path):
    result = run_launch(["--max-tokens", "8"], {"PAGEDSERVE_CACHE": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "demo-model" / "config.json").is_file()
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 3 and all(" -> " in line and line.endswith("[length]") for line in lines)


def test_launch_reports_bad_arguments(llama_model):
    result = run_launch(["--model", llama_model, "--tp", "2"])
    assert result.returncode == 2 and "tensor_parallel_size" in result.stderr
