"""The C++ CPU kernels (kernels/csrc: decode attention, GEMV, decoder layer) as one extension built on first use.

Built with -march=native; the build is cached under torch's extension root, keyed by the CPU's instruction flags,
the sources and the torch version, so a cached build is loaded only where it was made for.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from kernels.cpu_features import cpu_flags
from kernels.thread_priority import lowest_priority

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
logger = logging.getLogger(__name__)

_start_lock = threading.Lock()  # guards _builder
_lock = threading.Lock()  # held through a build or load
_done = threading.Event()  # set once a build or load has finished, whether or not it gave a module
_module: ModuleType | None = None
_builder: threading.Thread | None = None


def load(build_directory: str | None = None) -> ModuleType | None:
    """The compiled extension, built or loaded on the first call (waiting for a background build already under
    way) and reused after; None where it cannot be built.

    build_directory: where the first call looks for and puts the build (default: under torch's extension root);
    later calls ignore it.
    """
    global _module
    with _lock:
        if not _done.is_set():
            _module = _build(build_directory)
            _done.set()
    return _module


def start_background_build() -> None:
    """Load the cached build now, else build on a low-priority daemon thread, so a server answers at once: until
    ready() has the module, the layers run the torch paths, which compute the same results."""
    global _builder
    with _start_lock:
        if _done.is_set() or _builder is not None:
            return
        if _library(None).exists():  # a load takes milliseconds; at idle priority a busy engine would starve it
            load()
            return
        _builder = threading.Thread(target=_build_at_low_priority, name="cpu-kernel-build", daemon=True)
        _builder.start()


def required() -> ModuleType:
    """The extension (load()), for a caller with no other path: RuntimeError where it could not be built."""
    module = load()
    if module is None:
        raise RuntimeError("the C++ CPU kernels could not be built")
    return module


def ready() -> ModuleType | None:
    """The extension if its build or load has finished, without waiting for one under way; else None."""
    return _module if _done.is_set() else None


def _build_at_low_priority() -> None:
    lowest_priority()  # this thread alone, and the compiler processes it starts
    load()


def _extension_name() -> str:
    sources = "".join(path.read_text() for path in sorted(SOURCE_DIR.iterdir()))
    key = " ".join(sorted(cpu_flags())) + sources + torch.__version__
    return "pagedserve_cpu_kernels_" + hashlib.sha1(key.encode()).hexdigest()[:12]


def _library(build_directory: str | None) -> Path:
    """Where the build for this CPU, these sources and this torch is cached."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(build_directory or Path(get_default_build_root()) / "pagedserve")
    return root / f"{_extension_name()}.so"


def _build(build_directory: str | None) -> ModuleType | None:
    """The cached build, else a new one compiled in a private folder and then moved into the cache. torch's own
    cache shares a lock file between processes, which a process killed mid-build (a daemon thread at exit) leaves
    behind for every later one to wait on forever; a private folder has nothing to leave."""
    try:
        from torch.utils import cpp_extension

        library = _library(build_directory)
        name, root = library.stem, library.parent
        if library.exists():
            return _import(name, library)
        # Said in the log, since requests meanwhile take the slower paths and nothing else tells why.
        logger.info("compiling the C++ CPU kernels (first start with these sources on this CPU, about a minute on "
                    "an idle machine); until they are ready the engine runs the slower torch paths")
        started = time.monotonic()
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as private:
            module = cpp_extension.load(name, sources=[str(SOURCE_DIR / "module.cpp")],
                                        extra_include_paths=[str(SOURCE_DIR)],
                                        extra_cflags=["-O3", "-march=native", "-fopenmp"],
                                        extra_ldflags=["-fopenmp"], build_directory=private)
            os.replace(Path(private) / f"{name}.so", library)  # atomic: a concurrent builder's copy is the same
        logger.info("C++ CPU kernels compiled in %.0f s: the engine now runs its fused paths",
                    time.monotonic() - started)
        return module
    except Exception as exc:  # a missing or broken toolchain must only disable the fused paths
        logger.warning("C++ CPU kernels unavailable, using the torch paths: %s", exc)
        return None


def _import(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
