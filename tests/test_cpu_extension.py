"""Building the C++ CPU kernels: failures disable them, a killed build leaves nothing behind."""
from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from kernels import cpu_extension


def test_build_failure_yields_none(monkeypatch, tmp_path):
    import torch.utils.cpp_extension

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", broken)
    assert cpu_extension._build(str(tmp_path)) is None


# The build machinery under test is the same for any sources: it builds an empty module, which compiles far sooner
# than the kernels (the session's cpu_kernels_built fixture compiles those where no build is cached).
TINY_MODULE = """#include <Python.h>
#define NAME_(name) #name
#define NAME(name) NAME_(name)
#define INIT_(name) PyInit_##name
#define INIT(name) INIT_(name)
static PyModuleDef tiny = {PyModuleDef_HEAD_INIT, NAME(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};
PyMODINIT_FUNC INIT(TORCH_EXTENSION_NAME)() { return PyModule_Create(&tiny); }
"""
WITH_TINY_SOURCES = "import sys; from pathlib import Path; from kernels import cpu_extension as k; " \
                    "k.SOURCE_DIR = Path(sys.argv[2]); "


def test_a_build_killed_midway_leaves_nothing_for_the_next_process_to_wait_on(tmp_path):
    """A process that exits while its daemon thread builds: the next one builds (or loads) regardless, and says in
    the log when the compile starts (the engine runs the slower paths meanwhile) and when it ends."""
    sources, builds = tmp_path / "csrc", tmp_path / "builds"
    sources.mkdir()
    (sources / "module.cpp").write_text(TINY_MODULE)
    # It exits as soon as its build's private folder appears: a fixed wait outlasted the tiny module's whole build
    # on a fast machine, which then left a finished build.
    script = WITH_TINY_SOURCES + ("import time; k._build_at_low_priority = lambda: k.load(sys.argv[1]); "
                                  "k.start_background_build(); "
                                  "[time.sleep(0.005) for _ in iter(lambda: any(Path(sys.argv[1]).glob('.build-*')), "
                                  "True)]")
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", script, str(builds), str(sources)], cwd=root, check=True, timeout=120)
    loaded = subprocess.run([sys.executable, "-c", WITH_TINY_SOURCES + "import logging; "
                             "logging.basicConfig(level=logging.INFO); print(k.load(sys.argv[1]) is not None)",
                             str(builds), str(sources)],
                            cwd=root, capture_output=True, text=True, timeout=300)
    assert loaded.stdout.strip() == "True", loaded.stderr
    assert "compiling the C++ CPU kernels" in loaded.stderr
    assert "the engine runs the slower torch paths" in loaded.stderr
    assert "C++ CPU kernels compiled in" in loaded.stderr
    assert [p.suffix for p in builds.iterdir() if not p.name.startswith(".build-")] == [".so"]


def test_no_pairs_conversion_is_left_out_of_line(cpu_kernels_built):
    """The pairs functors' per-column-pair conversions run inside the products' loops: the built module has no
    function of their own (GCC once called Int4Pairs' out of line, a call a column pair, once enough row counts
    instantiated it)."""
    library = cpu_extension._library(None)
    assert library.exists()
    symbols = subprocess.run(["nm", "--demangle", str(library)], capture_output=True, text=True, check=True).stdout
    assert "pagedserve::" in symbols  # the kernels' own functions are listed
    assert [line for line in symbols.splitlines() if "Pairs::operator()" in line] == []


# The kernels build with -march=native, so each machine compiles only its own side of the sources' #if blocks; these
# levels reach every side: AVX2 alone, AVX-512 without BF16 (Skylake-X, Cascade Lake), and BF16 with AMX.
INSTRUCTION_SETS = ["haswell", "skylake-avx512", "sapphirerapids"]


@pytest.mark.parametrize("march", INSTRUCTION_SETS)
def test_the_kernels_compile_for_every_instruction_set_level(march):
    """A name declared under one #if and used under a wider one breaks the build only on the CPUs in between: the
    sources must parse (g++ -fsyntax-only, with the build's includes) at each level."""
    includes = [f"-I{path}" for path in (*cpp_extension.include_paths(), sysconfig.get_paths()["include"],
                                         cpu_extension.SOURCE_DIR)]
    result = subprocess.run(["g++", "-std=c++20", "-fsyntax-only", f"-march={march}", "-fopenmp", *includes,
                             str(cpu_extension.SOURCE_DIR / "module.cpp")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
