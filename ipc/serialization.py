"""msgpack (msgspec) encoding for messages between processes; tensors and arrays travel as raw frames.

A message becomes [body, buffer, buffer, ...]: the body is msgpack, and each torch tensor or numpy array
in it is a small ext record (dtype, shape, frame index) whose bytes are a separate frame, handed to the
socket without a copy. Nothing is ever pickled: an object msgspec cannot encode raises TypeError.
torch is imported only when a tensor frame is decoded, so a client library that never sees one stays light.
"""
from __future__ import annotations

import sys
from typing import Any

import msgspec
import numpy as np

_TENSOR_EXT = 1
_NDARRAY_EXT = 2
_TORCH_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8",
                           "bool"})
Frame = bytes | bytearray | memoryview


class Encoder:
    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._buffers: list[memoryview] = []

    def encode(self, obj: Any) -> list[Frame]:
        self._buffers = []
        body = self._encoder.encode(obj)
        buffers, self._buffers = self._buffers, []
        return [body, *buffers]

    def _enc_hook(self, obj: Any) -> msgspec.msgpack.Ext:
        # Without torch loaded in this process, obj cannot be a tensor: no need to import it to ask.
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            tensor = obj.detach().cpu().contiguous()
            raw = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
            return self._ext(_TENSOR_EXT, str(tensor.dtype).removeprefix("torch."), tensor.shape, raw)
        if isinstance(obj, np.ndarray):
            array = np.ascontiguousarray(obj)
            if array.dtype.hasobject:
                raise TypeError("numpy arrays of Python objects cannot be sent")
            return self._ext(_NDARRAY_EXT, array.dtype.str, array.shape, memoryview(array).cast("B"))
        raise TypeError(f"{type(obj).__name__} cannot be sent between processes (only msgspec types, "
                        "tensors and numpy arrays)")

    def _ext(self, code: int, dtype: str, shape, raw: memoryview) -> msgspec.msgpack.Ext:
        self._buffers.append(raw)
        # Frame 0 is the body, so buffer i travels as frame i + 1.
        return msgspec.msgpack.Ext(code, msgspec.msgpack.encode((dtype, list(shape), len(self._buffers))))


class Decoder:
    """Decodes [body, buffers...] into `type`; raises msgspec.DecodeError/ValidationError on a bad message."""

    def __init__(self, type: Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(type, ext_hook=self._ext_hook)
        self._frames: list[Frame] = []

    def decode(self, frames: list[Frame]) -> Any:
        if not frames:
            raise msgspec.DecodeError("empty message")
        self._frames = frames
        try:
            return self._decoder.decode(frames[0])
        finally:
            self._frames = []

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        dtype, shape, index = msgspec.msgpack.decode(data, type=tuple[str, list[int], int])
        if not 0 < index < len(self._frames):
            raise msgspec.DecodeError(f"the message refers to frame {index}, which it does not have")
        buffer = _writable(self._frames[index])
        if code == _NDARRAY_EXT:
            return np.frombuffer(buffer, dtype=np.dtype(dtype)).reshape(shape)
        if code == _TENSOR_EXT and dtype in _TORCH_DTYPES:
            import torch

            flat = torch.frombuffer(buffer, dtype=torch.uint8) if len(buffer) else torch.empty(0, dtype=torch.uint8)
            return flat.view(getattr(torch, dtype)).reshape(shape)
        raise msgspec.DecodeError(f"unknown extension type {code} / dtype {dtype!r}")


def _writable(frame: Frame) -> bytearray | memoryview:
    """torch.frombuffer needs writable memory: a received frame is used in place if it is, else copied once."""
    view = memoryview(frame)
    return view if not view.readonly else bytearray(view)
