"""A CPU stand-in for an accelerator: find ops that would mix host and device tensors.

There is no GPU in CI, but ``EngineConfig.device="cpu:0"`` behaves like ``cpu`` while
naming a device *index*: :class:`DeviceMixChecker` (a ``TorchFunctionMode``) tags every
tensor created on ``cpu:0`` (``device=`` of a factory, ``.to(cpu:0)``) as a *device*
tensor and every other one as *host*, propagates the tags through ops, and records each op
that CUDA would refuse ("Expected all tensors to be on the same device"):

* any op over device and host tensors (0-dim host tensors pass: CUDA takes them as scalars),
  a device tensor with a CPU ``torch.Generator`` included;
* advanced indexing of a host tensor with device indices;
* an advanced-index write (``t[idx] = v``) whose non-scalar value is on the other side
  (indices may be host: torch moves them; a basic-slice write is a ``copy_``, fine).

``copy_`` / ``to`` / ``cpu`` cross freely, as on CUDA. ``tensor.device`` reads ``cpu:0`` for
device tensors, so code that derives a device from a tensor keeps it. Tags live on storages
(views and ``nn.Parameter`` share them). Heuristic, not a proof: an op CUDA accepts with
mixed devices but this flags (or the reverse) shows up as a false alarm (or a miss).
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

DEVICE = torch.device("cpu", 0)
HOST = torch.device("cpu")

_FACTORIES = {
    "tensor", "as_tensor", "arange", "zeros", "ones", "full", "empty", "rand", "randn",
    "randint", "randperm", "linspace", "scalar_tensor", "eye", "empty_strided", "from_numpy",
}  # fmt: skip
_LIKE = {"zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like"}
_NEW = {"new_zeros", "new_ones", "new_full", "new_empty", "new_tensor"}
_CROSS = {"copy_", "to", "cpu", "cuda", "pin_memory", "numpy", "tolist", "item", "__setitem__",
          "__getitem__", "data_ptr", "untyped_storage", "__get__", "__set__", "set_"}  # fmt: skip


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _is_marker(device: Any) -> bool | None:
    """True: names the stand-in device; False: the host; None: no device given."""
    if device is None:
        return None
    if isinstance(device, int):
        return True  # an index: an accelerator
    d = torch.device(device)
    return d.type != "cpu" or d.index is not None


class DeviceMixChecker(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self._device_storages: set[int] = set()
        self.violations: list[str] = []

    # ------------------------------------------------------------ tags
    def is_device(self, t: torch.Tensor) -> bool:
        return t.untyped_storage()._cdata in self._device_storages

    def _tag(self, out: Any, device: bool) -> None:
        for t in _tensors(out):
            key = t.untyped_storage()._cdata
            if device:
                self._device_storages.add(key)
            else:
                self._device_storages.discard(key)

    def _flag(self, what: str) -> None:
        frames = [f for f in traceback.extract_stack() if "/src/kvcanary/" in f.filename]
        where = " <- ".join(f"{f.filename.split('/src/')[-1]}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))
        msg = f"{what} at {where or '?'}"
        if msg not in self.violations:
            self.violations.append(msg)

    # ------------------------------------------------------------ dispatch
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__" and getattr(func, "__self__", None) is torch.Tensor.device:
            return DEVICE if self.is_device(args[0]) else HOST
        out = func(*args, **kwargs)
        if name in _FACTORIES:
            marker = _is_marker(kwargs.get("device"))
            src = next(iter(_tensors(args[:1])), None) if name in ("tensor", "as_tensor") else None
            if src is not None:
                return self._moved(src, out, marker if marker is not None else self.is_device(src))
            self._tag(out, bool(marker))
            return out
        if name in _LIKE or name in _NEW:
            marker = _is_marker(kwargs.get("device"))
            self._tag(out, marker if marker is not None else self.is_device(args[0]))
            return out
        if name in _CROSS:
            return self._cross(name, args, kwargs, out)
        self._generic(name, args, kwargs, out)
        return out

    def _generic(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        ts = list(_tensors(args)) + list(_tensors(kwargs))
        if not ts:
            return
        tags = [self.is_device(t) for t in ts]
        strict = {tag for t, tag in zip(ts, tags, strict=True) if tag or t.dim() > 0}
        if len(strict) > 1:
            self._flag(f"{name}: device and host tensors")
        gens = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Generator)]
        if gens and any(tags):
            self._flag(f"{name}: a device tensor with a CPU generator")
        if any(isinstance(o, torch.Tensor) for o in _tensors(out)):
            self._tag(out, any(tags))

    def _moved(self, src: torch.Tensor, out: Any, device: bool) -> Any:
        """``out`` of moving ``src`` to the device (``device``) or the host: a copy when it
        changes sides, as on a real accelerator (on the CPU ``.to`` may return ``src``)."""
        if not isinstance(out, torch.Tensor) or not isinstance(src, torch.Tensor):
            return out
        if self.is_device(src) != device and out.untyped_storage()._cdata == src.untyped_storage()._cdata:
            out = out.clone()
        self._tag(out, device)
        return out

    def _cross(self, name: str, args: tuple, kwargs: dict, out: Any) -> Any:
        if name == "to":
            marker = _is_marker(kwargs.get("device"))
            for a in args[1:]:
                if isinstance(a, torch.Tensor):
                    marker = self.is_device(a)
                elif isinstance(a, (str, torch.device, int)):
                    marker = _is_marker(a)
            return self._moved(args[0], out, marker if marker is not None else self.is_device(args[0]))
        if name in ("cpu", "pin_memory"):
            return self._moved(args[0], out, False)
        if name == "cuda":
            return self._moved(args[0], out, True)
        if name == "__getitem__":
            base, idx = args[0], args[1]
            if not self.is_device(base) and any(self.is_device(t) for t in _tensors(idx)):
                self._flag("__getitem__: host tensor indexed with device indices")
            if isinstance(out, torch.Tensor):
                self._tag(out, self.is_device(base))
        elif name == "__setitem__":
            base, idx, value = args[0], args[1], args[2]
            dev = self.is_device(base)
            if not dev and any(self.is_device(t) for t in _tensors(idx)):
                self._flag("__setitem__: host tensor indexed with device indices")
            items = idx if isinstance(idx, tuple) else (idx,)
            advanced = any(isinstance(i, (torch.Tensor, list)) for i in items)
            if (
                advanced
                and isinstance(value, torch.Tensor)
                and (value.dim() > 0 or self.is_device(value))
                and self.is_device(value) != dev
            ):
                self._flag("__setitem__: advanced-index write of a value on the other device")
        return out
