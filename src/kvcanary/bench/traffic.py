"""Bytes one forward moves: the canary's (records + real-KV fingerprints) against the KV
bytes attention reads, computed from the forward's batch shape (no measurement).

For the pools our engine builds (``MHAKVPool``: one FULL group over every layer;
``SWAKVPool``: a FULL group over the full-attention layers and an SWA group over the
sliding ones, window ``W``; see :mod:`kvcanary.canary.attach.registry`). Per request row ``r`` of
the forward, ``p_r`` = prefix length (tokens already cached), ``e_r`` = extend length (new
tokens, 1 in decode)::

    position              0 ..... p-W  p-W+1 ..... p-1  p ..... p+e-1
    full layers read      [--------------------------------------------]
    sliding layers read                [-------------------------------]
    FULL group verifies   [---------------------------]
    SWA group verifies           [--------------------]   (W positions; the first
    written (HEAD, TAIL)                                 [-------------]  anchors the chain)

    verified(g, r)  = p_r                  FULL group
                    = min(p_r, W)          SWA group   (canary/plan/jit.py plan_counts)
    written(r)      = e_r

    canary bytes = sum over groups g, rows r of
          2 stages (HEAD, TAIL) x H_g x 32 B x (verified(g, r) + written(r))   records
                                                             read (verify), written (write);
                                                             see TAIL_VERIFIES_UNFINGERPRINTED
        + H_g x F_g x (verified(g, r) + written(r))          TAIL fingerprints of the live KV
        + H_g x (F_g + 32 B x S_g) x written(r)              the store check (with sources):
                                                             the stored rows folded, 16 B of
                                                             scratch written and read per source

    H_g = halves launched (1: K; 2 with --kv-canary-v-half)
    S_g = fingerprinted layers of the group per half (0 with --kv-canary-real-data none;
          1 with real_data_layers first, else the group's layers, at most 4)
    F_g = S_g x read bytes per slot (partial: 16 B; all: the layer's K (or V) row,
          kv_heads x head_dim x dtype bytes)

    KV read bytes = sum over layers l, rows r of 2 (K, V) x kv_heads x head_dim x dtype
        bytes x read(l, r),   read(l, r) = p_r + e_r                      full layer
                                         = p_r + e_r - max(0, p_r - W + 1)  sliding layer

Left out: the req->token and full->SWA index reads (both sides read the page tables), the
K/V that attention writes, the one predecessor record a row's first verify entry reads and
(``--kv-canary-verify-tokens``) the expected-token reads. Padding rows of a graph replay are
not rows here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvcanary.canary.config import CanaryConfig
from kvcanary.canary.wire.constants import (
    CANARY_SLOT_BYTES,
    MAX_REAL_KV_SOURCES,
    REAL_KV_PARTIAL_READ_BYTES,
)
from kvcanary.model.config import SLIDING_ATTENTION, ModelConfig

# TAIL verifies what HEAD verified, also for halves without real-KV sources (then it checks
# the same records again; canary/forward.py). tests/bench pins this to the canary's
# own counters.
TAIL_VERIFIES_UNFINGERPRINTED = True
# Store-check scratch per source and written token: the intended fold and its target slot
# (int64 each), written at the store and read back at TAIL.
STORE_SCRATCH_BYTES = 2 * 2 * 8


class StepShape(NamedTuple):
    """The request rows of one forward (padding rows left out)."""

    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]


class GroupTraffic(NamedTuple):
    """What one canary buffer group touches per slot."""

    window: int | None  # SWA groups verify only the last ``window`` positions
    num_halves: int  # H_g
    num_sources: int  # S_g
    fingerprint_bytes: int  # F_g: real-KV bytes read per slot per half at TAIL


class ForwardBytes(NamedTuple):
    canary: int
    kv_read: int


def kv_bytes_per_token(model: ModelConfig, dtype_bytes: int) -> int:
    """One layer's K (or V) row of one token."""
    return model.num_key_value_heads * model.head_dim * dtype_bytes


def canary_groups(model: ModelConfig, canary: CanaryConfig, dtype_bytes: int) -> list[GroupTraffic]:
    """The groups the canary attaches to our engine's pool for ``model`` (empty: mode none).

    Raises ``ValueError`` where attaching would (``real_data_layers=all`` over more than 4
    layers of a group), and for DeepSeek-V4 models (compressed groups: not modelled)."""
    if model.dsv4 is not None:
        raise ValueError(f"{model.architecture}: the bytes model covers MHA and SWA pools only")
    if not canary.enabled:
        return []
    halves = 2 if canary.v_half else 1
    row_bytes = kv_bytes_per_token(model, dtype_bytes)
    read_bytes = {"none": 0, "partial": min(REAL_KV_PARTIAL_READ_BYTES, row_bytes),
                  "all": row_bytes}[canary.real_data]  # fmt: skip

    def group(name: str, num_layers: int, window: int | None) -> GroupTraffic:
        sources = 0
        if read_bytes and num_layers:
            sources = 1 if canary.real_data_layers == "first" else num_layers
        if sources > MAX_REAL_KV_SOURCES:
            raise ValueError(
                f"--kv-canary-real-data-layers=all: the {name} group has {num_layers} layers; "
                f"allowed at most {MAX_REAL_KV_SOURCES} fingerprinted layers per half"
            )
        return GroupTraffic(window, halves, sources, sources * read_bytes)

    if not model.has_sliding:
        return [group("FULL", model.num_hidden_layers, None)]
    return [group("FULL", len(model.full_layer_ids), None),
            group("SWA", len(model.swa_layer_ids), model.sliding_window)]  # fmt: skip


def canary_bytes(step: StepShape, groups: Sequence[GroupTraffic]) -> int:
    """Canary bytes of one forward (module doc)."""
    total = 0
    for g in groups:
        for p, e in zip(step.prefix_lens, step.extend_lens, strict=True):
            verified = p if g.window is None else min(p, g.window)
            tail_verified = verified if g.num_sources or TAIL_VERIFIES_UNFINGERPRINTED else 0
            total += g.num_halves * CANARY_SLOT_BYTES * (verified + e + tail_verified + e)
            if g.num_sources:
                total += g.num_halves * g.fingerprint_bytes * (verified + e)
                total += g.num_halves * (g.fingerprint_bytes + STORE_SCRATCH_BYTES * g.num_sources) * e
    return total


def kv_read_bytes(step: StepShape, model: ModelConfig, dtype_bytes: int) -> int:
    """KV bytes attention reads in one forward (module doc)."""
    per_position = 2 * kv_bytes_per_token(model, dtype_bytes)
    window = model.sliding_window
    total = 0
    for layer_type in model.layer_types:
        for p, e in zip(step.prefix_lens, step.extend_lens, strict=True):
            read = p + e
            if layer_type == SLIDING_ATTENTION and window is not None:
                read -= max(0, p - window + 1)
            total += per_position * read
    return total


def forward_bytes(step: StepShape, model: ModelConfig, groups: Sequence[GroupTraffic],
                  dtype_bytes: int) -> ForwardBytes:  # fmt: skip
    return ForwardBytes(canary_bytes(step, groups), kv_read_bytes(step, model, dtype_bytes))
