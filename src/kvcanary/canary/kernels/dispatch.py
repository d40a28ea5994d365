"""Canary verify/write kernels: the contract, and the per-device choice of implementation.

Every backend (:mod:`.kernels_numba` for CPU, :mod:`.kernels_triton` for CUDA,
:mod:`.kernels_torch` for any device) and the test-only Python reference implement exactly
this, bit for bit (ring rows in the same order). ``auto`` picks numba on CPU tensors, Triton
on CUDA tensors when the ``triton`` package is installed (extra ``gpu``), torch otherwise:

**verify(records, plan, ring, tag)** — for each plan entry ``i`` in order::

    slot == 0                       skip (reserved padding slot; still counts as processed)
    expected_chain = stored prev_hash            if prev_slot == 0   (predecessor unreachable)
                   = ANCHOR_HASH                 if prev_slot <  0   (first token)
                   = chain_hash(record[prev_slot]) otherwise
    VERIFY_CHAIN_HASH_MISMATCH    prev_slot != 0 and stored prev_hash != expected_chain
    VERIFY_TOKEN_MISMATCH         check_token and expected_token != -1 and stored token differs
    VERIFY_POSITION_MISMATCH      stored position != expected position
    VERIFY_REAL_KV_HASH_MISMATCH  stored real_kv_hash != fingerprint of the live KV (0 without
                                  sources, so HEAD buffers must hold 0)
    any bit → ring row (tag, slot, stored position, stored token, expected token or -1 when
              check_token is off, stored prev_hash, expected_chain, bits)

**write(records, plan, ring, tag)** — all seeds are range-checked first; then per request, in
order (each seed read when its request starts, so an earlier request's store to it — a
remapped entry — is seen, as in SGLang's ``write_ref``)::

    running = ANCHOR_HASH if seed < 0 else chain_hash(record[seed])
    position assert armed iff chain_position_assert and seed >= 0; prev = record[seed].position
    for each token (slot < 0: skipped entirely):
        write-input assert (plan has expected inputs): WRITE_TOKEN_MISMATCH / WRITE_POSITION_MISMATCH
            → row (tag, slot, position, token, expected token, running, expected position, bits)
        armed and position != prev + 1 → row (tag, slot, position, token, token, running,
            prev + 1, WRITE_POSITION_MISMATCH); then prev = position
        record[slot] = (token, position, running, fingerprint of the live KV or 0)
        running = chain_hash(running, token, position)   # always the ACTUAL values

**reader_chain** (verify and launch, every backend and plan): an entry
*linked* to the entry before it (a row plan's every entry but its row's first; a
materialised plan's entry whose ``prev_slot > 0`` is the slot of the entry before it)
is also checked against the *reading request's own chain*::

    reader[i] = chain_hash(reader[i-1] if i-1 is linked else expected_chain[i-1],
                           expected_token[i-1] (the stored token when -1 or not checked),
                           expected position[i-1])
    VERIFY_CHAIN_HASH_MISMATCH    linked and stored prev_hash != reader[i]
                                  (the row's expected_chain is then reader[i], unless the
                                  stored-predecessor check failed too)

    an entry whose token is not checked and that fails a chain, token or position check
    ends the run (the next entry is not linked): its stored token cannot stand in for the
    reader's, whose history is then unknown

Where every entry passes the other checks the reader chain *is* the stored chain (by
induction), so clean rows cost nothing more (a row plan's fast check is unchanged). What it
adds: every slot after the first one whose token, position or chain is not the reader's
is named, since its KV was computed under another prefix (a false prefix hit on a block
whose last token differs names the whole hit, not its one differing slot). SGLang does not
define it: its cross-checks run with it off. With every token unchecked it changes nothing
(a failing entry ends the run), so the torch and Triton verifies skip it without
``check_token``; with it, the torch verify reads the device once (its sequential part: no
CUDA graph capture, :mod:`.torch_kernels`), the Triton verify does not.

Duplicate slots within one write keep the last token's record. Slots outside the buffer
raise. ``counters`` (optional) count one launch per call and the entries processed (verify:
all entries of an enabled plan; write: tokens stored). A disabled verify plan does nothing
but count the launch.

**launch(records, verify_plan, write_plan, ring, tag, write_first)** — :func:`verify` then
:func:`write` of one launch, or with ``write_first`` :func:`write` then :func:`verify` (a
HEAD of a per-position group: the alias check, below); a CPU row plan runs both in one
compiled call (the per-forward path: after a forward has evicted the caches, each
Python-to-native crossing costs microseconds).

**The alias check.** A HEAD writes this forward's records (every FULL and SWA group's: groups
may share a record buffer, as vLLM's do) before it verifies the slots the forward reads
(``forward.SingleForwardManager``, the fused HEAD), so a slot the forward writes that some row also reads at another position
(a slot freed and handed out again inside one forward, one physical page at two indices of
a row) fails that row's verify (``verify_position``, and the token and chain bits of the
other token) at HEAD, without fingerprints. A slot read and written at the *same* position
(a same-step prefix hit) verifies against the record just written: the same token,
position and chain when the reader's prefix is the writer's.

Plans come materialised (:mod:`.plan`, or :mod:`.plan_triton` on CUDA; any backend) or as
CPU row plans (:mod:`.row_plan`, the numba backend only: the per-forward path on the CPU);
both give the same result.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from functools import cache
from types import ModuleType
from typing import Literal

import torch

from kvcanary.canary.kernels import numba_kernels as kernels_numba
from kvcanary.canary.kernels import torch_kernels as kernels_torch
from kvcanary.canary.plan.types import HostWritePlan, RowVerifyPlan, VerifyPlan, WritePlan
from kvcanary.canary.report.ring import RunCounters, ViolationRing
from kvcanary.canary.wire.real_kv import RealKvSource

Backend = Literal["auto", "numba", "torch", "triton"]
BACKENDS: tuple[Backend, ...] = ("auto", "numba", "torch", "triton")
_ROW_PLAN_BACKENDS = ("auto", "numba")
TRITON_MISSING = "needs the triton package, which is not installed (pip install 'kvcanary[gpu]')"


@cache
def triton_installed() -> bool:
    """Whether ``triton`` can be imported (looked up once; importing it costs ~1 s)."""
    return importlib.util.find_spec("triton") is not None


def triton_kernels() -> ModuleType:
    """:mod:`.kernels_triton`, imported on first use (the CPU install has no triton)."""
    if not triton_installed():
        raise ValueError(f"canary kernel backend='triton' {TRITON_MISSING}")
    return importlib.import_module("kvcanary.canary.kernels.triton_kernels")


def _module(records: torch.Tensor, backend: Backend, plan: object) -> ModuleType:
    if backend not in BACKENDS:
        raise ValueError(f"canary kernel backend={backend!r}; allowed: {', '.join(BACKENDS)}")
    if isinstance(plan, (RowVerifyPlan, HostWritePlan)):  # CPU row plans: numba only
        if backend not in _ROW_PLAN_BACKENDS:
            raise ValueError(f"canary kernel backend={backend!r} got a CPU row plan (numba only)")
        return kernels_numba
    on = records.device.type
    if backend == "numba" or (backend == "auto" and on == "cpu"):
        return kernels_numba
    if backend == "triton" or (backend == "auto" and on == "cuda" and triton_installed()):
        return triton_kernels()
    return kernels_torch


def verify(
    records: torch.Tensor,
    plan: VerifyPlan | RowVerifyPlan,
    ring: ViolationRing,
    launch_tag: int,
    *,
    real_kv_sources: Sequence[RealKvSource] = (),
    check_token: bool = False,
    counters: RunCounters | None = None,
    backend: Backend = "auto",
    reader_chain: bool = False,
) -> None:
    """Verify ``plan``'s entries against the canary buffer ``records`` (see module doc)."""
    if type(plan) is RowVerifyPlan and backend in _ROW_PLAN_BACKENDS:  # the per-forward path
        kernels_numba.verify_rows(records, plan, ring, launch_tag, real_kv_sources, check_token,
                                  counters, reader_chain)  # fmt: skip
        return
    _module(records, backend, plan).verify(
        records, plan, ring, launch_tag, real_kv_sources=real_kv_sources,
        check_token=check_token, counters=counters, reader_chain=reader_chain,
    )  # fmt: skip


def launch(
    records: torch.Tensor,
    verify_plan: VerifyPlan | RowVerifyPlan,
    write_plan: WritePlan | HostWritePlan,
    ring: ViolationRing,
    launch_tag: int,
    *,
    real_kv_sources: Sequence[RealKvSource] = (),
    check_token: bool = False,
    chain_position_assert: bool = False,
    verify_counters: RunCounters | None = None,
    write_counters: RunCounters | None = None,
    backend: Backend = "auto",
    write_first: bool = False,
    reader_chain: bool = False,
) -> None:
    """One launch: :func:`verify` then :func:`write` of the same records, or the write
    first (the alias check: module doc); a CPU row plan runs both in one compiled call."""
    if (type(verify_plan) is RowVerifyPlan and type(write_plan) is HostWritePlan
            and backend in _ROW_PLAN_BACKENDS):  # fmt: skip
        kernels_numba.launch_rows(records, verify_plan, write_plan, ring, launch_tag,
                                  real_kv_sources, check_token, chain_position_assert,
                                  verify_counters, write_counters, write_first,
                                  reader_chain)  # fmt: skip
        return
    if not write_first:
        verify(records, verify_plan, ring, launch_tag, real_kv_sources=real_kv_sources,
               check_token=check_token, counters=verify_counters, backend=backend,
               reader_chain=reader_chain)  # fmt: skip
    write(records, write_plan, ring, launch_tag, real_kv_sources=real_kv_sources,
          chain_position_assert=chain_position_assert, counters=write_counters,
          backend=backend)  # fmt: skip
    if write_first:
        verify(records, verify_plan, ring, launch_tag, real_kv_sources=real_kv_sources,
               check_token=check_token, counters=verify_counters, backend=backend,
               reader_chain=reader_chain)  # fmt: skip


def write(
    records: torch.Tensor,
    plan: WritePlan | HostWritePlan,
    ring: ViolationRing,
    launch_tag: int,
    *,
    real_kv_sources: Sequence[RealKvSource] = (),
    chain_position_assert: bool = False,
    counters: RunCounters | None = None,
    backend: Backend = "auto",
) -> None:
    """Write this forward's records into ``records`` (see module doc)."""
    _module(records, backend, plan).write(
        records, plan, ring, launch_tag, real_kv_sources=real_kv_sources,
        chain_position_assert=chain_position_assert, counters=counters,
    )  # fmt: skip
