"""The gateway's LoRA adapters: served names (the request's `model`) → LoRARequest, from --lora-modules and, with
--allow-runtime-lora, /v1/load_lora_adapter for folders under --lora-dir only (no arbitrary paths from the
network)."""
from __future__ import annotations

import json
import zlib
from pathlib import Path

from frontend.api.errors import APIError
from ipc import LoRARequest


class LoRAAdapters:
    def __init__(self, base_model: str, modules: dict[str, str], runtime_dir: str | None = None) -> None:
        """modules: name → adapter folder; runtime_dir: where runtime loads may come from (None: no runtime
        loading). Folders are checked by the engine when a request first names them (a bad one: HTTP 400)."""
        self.base_model = base_model
        self.runtime_dir = Path(runtime_dir).resolve() if runtime_dir else None
        self.adapters: dict[str, LoRARequest] = {}
        for name, path in modules.items():
            self._add(name, path)

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model (or no model); 404 for an unknown one."""
        if model is None or model == self.base_model:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            served = ", ".join([repr(self.base_model), *map(repr, self.adapters)])
            raise APIError(404, f"the model {model!r} does not exist; this server has {served}", "model",
                           "model_not_found")
        return adapter

    def models(self) -> list[tuple[str, str]]:
        """(name, folder) of each adapter, in load order."""
        return [(name, request.lora_path) for name, request in self.adapters.items()]

    def candidate(self, name: str, path: str) -> LoRARequest:
        """The adapter /v1/load_lora_adapter would add (APIError if the name or folder cannot be); `add` it once the
        engine has checked its files."""
        if self.runtime_dir is None:
            raise APIError(404, "runtime LoRA loading is off: start the server with --allow-runtime-lora and "
                                "--lora-dir", "lora_name", "not_found")
        for field, value in (("lora_name", name), ("lora_path", path)):
            if any(ord(char) < 32 for char in value):
                raise APIError(400, f"{field} must not hold control characters (NUL, newlines, ...)", field)
        folder = (self.runtime_dir / path).resolve()
        if not folder.is_relative_to(self.runtime_dir):
            raise APIError(400, f"lora_path must be a folder under the server's --lora-dir; {path!r} is not",
                           "lora_path")
        if not (folder / "adapter_config.json").is_file():
            raise APIError(400, f"lora_path {path!r} holds no adapter_config.json", "lora_path")
        if name == self.base_model or name in self.adapters:
            raise APIError(400, f"the model name {name!r} is already in use; unload it first", "lora_name")
        return _request(name, str(folder))

    def add(self, adapter: LoRARequest) -> None:
        if adapter.lora_name == self.base_model or adapter.lora_name in self.adapters:
            raise APIError(400, f"the model name {adapter.lora_name!r} is already in use; unload it first",
                           "lora_name")
        self.adapters[adapter.lora_name] = adapter

    def unload(self, name: str) -> None:
        if self.runtime_dir is None:
            raise APIError(404, "runtime LoRA loading is off: start the server with --allow-runtime-lora and "
                                "--lora-dir", "lora_name", "not_found")
        if self.adapters.pop(name, None) is None:
            raise APIError(404, f"no LoRA adapter is named {name!r}", "lora_name", "not_found")

    def _add(self, name: str, path: str) -> None:
        self.adapters[name] = _request(name, path)


def _request(name: str, path: str) -> LoRARequest:
    # The id follows from the name and folder, so every gateway of an engine gives an adapter the same one.
    return LoRARequest(name, zlib.crc32(f"{name}\x00{path}".encode()) % (2**31 - 1) + 1, path)


def parse_lora_modules(values: list[str] | None) -> dict[str, str]:
    """--lora-modules NAME=PATH ... (or the launcher's JSON list of them) → {name: path}; ValueError for another
    shape or a repeated name."""
    modules: dict[str, str] = {}
    items = [v for value in values or [] for v in (json.loads(value) if value.startswith("[") else [value])]
    for value in items:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, not {value!r}")
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return modules
