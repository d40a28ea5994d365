"""Command-line flags of the engine configuration, and the parsed flags back into it.

Shared by :mod:`kvcanary.cli.command`, the benchmarks and the subcommands other packages contribute (e.g.
:mod:`kvcanary.disagg.cli_hooks`), which therefore never import the CLI itself.

Dataclasses whose fields carry their flag in ``metadata`` (``{"flag": "--x", "help": ...,
"choices": ...}``; ``{"flag": None}``: not a flag) turn into argparse arguments with
:func:`add_dataclass_flags` and back with :func:`dataclass_from_args`; the canary's options
(:class:`~kvcanary.canary.config.CanaryConfig`) and speculative decoding's
(:class:`~kvcanary.config.SpeculativeConfig`) are written that way.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from collections.abc import Iterator
from typing import Any, TypeVar

from kvcanary.canary.config import CanaryConfig
from kvcanary.config import EngineConfig, SpeculativeConfig

T = TypeVar("T")

_E = EngineConfig.field_default


def _flag_fields(cls: type) -> Iterator[tuple[dataclasses.Field[Any], str, str]]:
    """``(field, flag, argparse dest)`` of each field of ``cls`` that is a flag. Every field
    must say whether it is one (a field added without deciding is an error)."""
    for f in dataclasses.fields(cls):
        if "flag" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name}: metadata must name its flag "
                            "(or 'flag': None)")  # fmt: skip
        flag = f.metadata["flag"]
        if flag is not None:
            yield f, flag, flag[2:].replace("-", "_")


def add_dataclass_flags(p: argparse.ArgumentParser, cls: type) -> None:
    """One argument per flag field of dataclass ``cls``, its default the field's: bool →
    ``store_true`` (the default must be False), int / float → ``type``, ``choices`` and
    ``help`` (which may say ``%(default)s``) from the metadata."""
    hints = typing.get_type_hints(cls)
    for f, flag, dest in _flag_fields(cls):
        kind = hints[f.name]
        default = _default(f)
        kw: dict[str, Any] = {"dest": dest, "help": f.metadata.get("help")}
        if kind is bool:
            if default is not False:
                raise TypeError(f"{cls.__name__}.{f.name}: a store_true flag needs default False")
            kw["action"] = "store_true"
        elif kind in (int, float, str):
            kw.update(type=kind, default=default)
            if f.metadata.get("choices") is not None:
                kw["choices"] = f.metadata["choices"]
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: type {kind} cannot be a flag")
        p.add_argument(flag, **kw)


def _default(f: dataclasses.Field[Any]) -> Any:
    """A field's default; None where its factory (an environment variable) fails, so that
    ``--help`` still works: the command itself reports the variable (see ``dataclass_from_args``)."""
    if not callable(f.default_factory):
        return f.default
    try:
        return f.default_factory()
    except ValueError:
        return None


def dataclass_from_args(cls: type[T], a: argparse.Namespace) -> T:
    """``cls`` from the parsed flags of :func:`add_dataclass_flags`; fields whose flag the
    command lacks (and fields that are no flag) keep their defaults. A None left by
    :func:`_default` is not passed, so the field's factory runs and raises its own error."""
    kwargs = {f.name: getattr(a, dest) for f, _, dest in _flag_fields(cls)
              if hasattr(a, dest) and not (getattr(a, dest) is None and callable(f.default_factory))}  # fmt: skip
    return cls(**kwargs)


def add_engine_flags(
    p: argparse.ArgumentParser, with_canary: bool = True, with_speculative: bool = True
) -> None:
    """The :class:`EngineConfig` flags (and, ``with_canary``, the ``--kv-canary*`` ones;
    ``with_speculative``, the ``--speculative-*`` / ``--num-speculative-tokens`` ones)."""
    p.add_argument("--model", default=_E("model"),
                   help="builtin:tiny-swa | builtin:tiny-swa-all | builtin:tiny-mha | builtin:tiny-dsv4 | builtin:qwen3-0.6b-shape | path to a HF model directory (default: %(default)s)")
    if with_canary:
        add_dataclass_flags(p, CanaryConfig)
    p.add_argument("--page-size", type=int, default=None,
                   help=f"KV page size in tokens (default: {_E('page_size')}, or a multiple of it that "
                        "every compression ratio of a DeepSeek-V4 model divides: 128 for builtin:tiny-dsv4)")
    p.add_argument("--max-total-tokens", type=int, default=_E("max_total_tokens"),
                   help="full KV pool size in tokens (default: %(default)s)")
    p.add_argument("--swa-full-tokens-ratio", type=float, default=_E("swa_full_tokens_ratio"),
                   help="SWA pool size / full pool size (default: %(default)s)")
    p.add_argument("--chunked-prefill-size", type=int, default=_E("chunked_prefill_size"),
                   help="max tokens per prefill forward, <= 0 disables chunking (default: %(default)s)")
    p.add_argument("--max-running-requests", type=int, default=_E("max_running_requests"),
                   help="most requests decoding at once; more wait for admission (default: %(default)s)")
    p.add_argument("--disable-prefix-cache", action="store_true", help="turn the radix prefix cache off")
    p.add_argument("--enable-host-offload", action="store_true",
                   help="retracted requests keep their KV in host memory instead of recomputing it")
    p.add_argument("--disable-graph", action="store_true", help="decode without the static-shape graph runner")
    p.add_argument("--device", default=_E("device"), help="torch device (default: %(default)s)")
    p.add_argument("--seed", type=int, default=_E("seed"),
                   help="seeds weights of builtin models, sampling and the workload (default: %(default)s)")
    if with_speculative:
        add_dataclass_flags(p, SpeculativeConfig)


def default_page_size(model: str) -> int:
    """The page size a model gets when ``--page-size`` is not given: the engine's default,
    raised to a multiple of every compression ratio the model uses (DeepSeek-V4)."""
    from kvcanary.model.loader import load_model_config

    return math.lcm(_E("page_size"), load_model_config(model).min_page_size)


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    """The :class:`EngineConfig` of :func:`add_engine_flags`' flags (commands without the
    canary flags: the canary off; without the speculative ones: speculation off)."""
    return EngineConfig(
        model=a.model,
        page_size=a.page_size if a.page_size is not None else default_page_size(a.model),
        max_total_tokens=a.max_total_tokens,
        swa_full_tokens_ratio=a.swa_full_tokens_ratio,
        chunked_prefill_size=a.chunked_prefill_size,
        max_running_requests=a.max_running_requests,
        enable_prefix_cache=not a.disable_prefix_cache,
        enable_host_offload=a.enable_host_offload,
        graph_batch_sizes=() if a.disable_graph else _E("graph_batch_sizes"),
        device=a.device,
        seed=a.seed,
        canary=dataclass_from_args(CanaryConfig, a),
        speculative=dataclass_from_args(SpeculativeConfig, a),
    )
