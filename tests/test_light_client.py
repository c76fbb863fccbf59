"""The client library stays light: attaching to an engine loads neither torch nor the engine (workers, core)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import msgspec
import pytest
import torch

import frontend
from core.engine_spawn import child_env
from ipc import Encoder

HEAVY = ("torch", "workers", "core", "core.engine_core", "transformers")
_REPORT_HEAVY = f"import json, sys; print(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))"


def run_child(code: str, *args: str, stdin: bytes | None = None) -> list[str]:
    """Runs `code` in a fresh interpreter and returns the heavy modules loaded by its end."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code) + "\n" + _REPORT_HEAVY, *args],
                          input=stdin, capture_output=True, env=child_env(), timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout.decode().splitlines()[-1])


def test_the_client_library_imports_nothing_heavy():
    assert run_child("""
        import frontend
        assert set(frontend.__all__) <= set(dir(frontend))
        from frontend import EngineCoreClient, AsyncEngineCoreClient
    """) == []


def test_every_name_of_frontend_resolves_lazily_to_its_home():
    from frontend.async_llm import AsyncLLM
    from frontend.llm import LLM
    from ipc import SamplingParams

    names = {name: getattr(frontend, name) for name in frontend.__all__}
    assert names["LLM"] is LLM and names["AsyncLLM"] is AsyncLLM and names["SamplingParams"] is SamplingParams
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        frontend.Nope  # noqa: B018


def test_ipc_imports_torch_only_to_decode_a_tensor():
    tensor = torch.arange(6, dtype=torch.bfloat16).view(2, 3)
    frames = [bytes(frame) for frame in Encoder().encode({"x": tensor, "a": [1, 2]})]
    loaded = run_child("""
        import sys, msgspec, numpy as np
        from ipc import Decoder, Encoder
        plain = Encoder().encode({"n": np.arange(3), "s": "text"})
        assert Decoder().decode(plain)["s"] == "text" and "torch" not in sys.modules
        decoded = Decoder().decode(msgspec.msgpack.decode(sys.stdin.buffer.read()))
        assert decoded["x"].dtype == sys.modules["torch"].bfloat16 and decoded["x"].tolist() == [[0, 1, 2], [3, 4, 5]]
    """, stdin=msgspec.msgpack.encode(frames))
    assert loaded == ["torch"]


_ATTACHED_ASYNC_LLM = """
    import asyncio, sys
    from frontend import AsyncLLM, SamplingParams

    async def main():
        llm = AsyncLLM(engine_address=sys.argv[1])
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        async for output in llm.generate({"prompt_token_ids": [5, 6, 7]}, params):
            pass
        assert len(output.outputs[0].token_ids) == 3
        llm.shutdown()

    asyncio.run(main())
"""


def test_an_attached_async_llm_loads_neither_torch_nor_the_engine(engine_address):
    assert not {"torch", "workers", "core", "core.engine_core"} & set(run_child(_ATTACHED_ASYNC_LLM, engine_address))
