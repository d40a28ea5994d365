"""Host (CPU) copies of a request's KV, for retraction and offload: the one place that
takes them (``get_cpu_copy(pool, slots)`` / ``load_cpu_copy(pool, copy, slots)``); the
pools themselves know nothing of host copies.

A copy holds one CPU tensor per *row buffer* of each sub-pool, in a fixed order::

    row buffers of a sub-pool = K layers ..., V layers ..., registered slot buffers ...

    MHAKVPool   {"full": [...]}                               rows = indices
    SWAKVPool   {"full": [...],                               rows = indices
                 "swa": [...],                                rows = indices where swa_mask
                 "swa_mask": cpu bool[len(indices)]}          mapping[indices] > 0 at save
    DSV4KVPool  {"swa": [...], "swa_mask": ...,               latent rows, as SWAKVPool's
                 "compressed": [...],                         C4, C4-indexer, C128 layers:
                                                              rows full // ratio of every
                                                              ratio-th index (one per window)
                 "state": [...]}                              each ring (C4 and its indexer's,
                                                              C128): the rows of the last
                                                              ``ring`` indices (the live tail
                                                              fits), restored where mapped
                                                              at save and at load

Row ``j`` of a "full" tensor is slot ``indices[j]``; row ``j`` of a "swa" tensor belongs to
the ``j``-th index whose mapping was > 0 when saved. Unmapped positions (out of the window,
never given an SWA slot by a tail allocation) have no SWA KV, and their translation 0 is the
sink slot, so they are skipped. Loading restores every full row and only the saved SWA rows
whose new index still has an SWA slot; SWA rows for new indices that were unmapped at save
time are left untouched (the window only slides forward, so they should be unmapped too).

Device gathers and scatters go ``chunk_size`` rows at a time, so a huge copy never needs a
device temporary larger than one chunk of one buffer.

Extra per-slot buffers ride along by registration: anything registered with
:meth:`MHAKVPool.register_slot_buffer` on a sub-pool is copied with that sub-pool's KV. The
canary registers its full-group records on ``pool.full_kv_pool`` (or the MHAKVPool itself) and
its SWA-group records on ``pool.swa_kv_pool``; callers of ``get_cpu_copy`` need not know.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import torch

from kvcanary.memory.base import KVPool
from kvcanary.memory.dsv4_pool import STATE_RING_SIZE, DSV4KVPool
from kvcanary.memory.mha_pool import MHAKVPool
from kvcanary.memory.swa_pool import SWAKVPool

DEFAULT_CHUNK_SIZE = 8192

# {"full": list[Tensor]} or {"full": ..., "swa": list[Tensor], "swa_mask": Tensor} (see
# above). Values stay Any: callers keep it as ``Req.host_copy`` and read ``["swa_mask"]``.
HostCopy: TypeAlias = dict[str, Any]


def _row_buffers(sub: MHAKVPool) -> list[torch.Tensor]:
    return sub.all_buffers() + sub.extra_slot_buffers


def _save(sub: MHAKVPool, slots: torch.Tensor, chunk_size: int) -> list[torch.Tensor]:
    out = []
    for buf in _row_buffers(sub):
        cpu = torch.empty((slots.numel(), *buf.shape[1:]), dtype=buf.dtype, pin_memory=buf.is_cuda)
        for s in range(0, slots.numel(), chunk_size):
            cpu[s : s + chunk_size].copy_(buf[slots[s : s + chunk_size]])
        out.append(cpu)
    return out


def _check_rows(sub: MHAKVPool, saved: list[torch.Tensor], num_rows: int, what: str) -> None:
    bufs = _row_buffers(sub)
    if len(saved) != len(bufs):
        raise ValueError(
            f"load_cpu_copy: {what} copy holds {len(saved)} buffers, the pool has {len(bufs)} "
            "(slot buffers registered between save and load?)"
        )
    for cpu, buf in zip(saved, bufs, strict=True):
        if cpu.shape[0] != num_rows or cpu.shape[1:] != buf.shape[1:]:
            raise ValueError(
                f"load_cpu_copy: {what} rows of shape {tuple(cpu.shape)} do not fit "
                f"{num_rows} rows of {tuple(buf.shape[1:])}"
            )


def _load(
    sub: MHAKVPool,
    saved: list[torch.Tensor],
    slots: torch.Tensor,
    src_rows: torch.Tensor | None,
    chunk_size: int,
) -> None:
    """``buf[slots[j]] = saved[src_rows[j]]`` (``src_rows`` None: row ``j``) per buffer."""
    for cpu, buf in zip(saved, _row_buffers(sub), strict=True):
        for s in range(0, slots.numel(), chunk_size):
            rows = (
                cpu[s : s + chunk_size] if src_rows is None else cpu[src_rows[s : s + chunk_size]]
            )
            buf[slots[s : s + chunk_size]] = rows.to(buf.device)


def _slots(pool: KVPool, indices: torch.Tensor, chunk_size: int) -> torch.Tensor:
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: must be >= 1 (default {DEFAULT_CHUNK_SIZE})")
    return indices.reshape(-1).to(pool.device, torch.int64)


def _unsupported(pool: KVPool) -> NotImplementedError:
    return NotImplementedError(
        f"host copy of {type(pool).__name__}: supported pools are MHAKVPool, SWAKVPool, DSV4KVPool"
    )


# ---------------------------------------------------------------------- DSV4
def _dsv4_parts(
    pool: DSV4KVPool, slots: torch.Tensor, swa: torch.Tensor
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """``(buffer, rows)`` of every compressed layer (one row per window of ``slots``) and
    every compress-state ring (rows of the last ``ring`` of ``slots``; 0 where unmapped)."""
    compressed, state = [], []
    for layer_id, entry in enumerate(pool.layer_mapping):
        if entry.ratio == 0:
            continue
        rows = pool.compressed_loc(layer_id, slots[:: entry.ratio])
        compressed.append((pool.get_compressed_buffer(layer_id), rows))
        if entry.ratio == 4:
            compressed.append((pool.get_indexer_buffer(layer_id), rows))
        tail = swa[-STATE_RING_SIZE[entry.ratio] :]
        ring_rows = pool.state_loc(layer_id, tail.clamp(min=0)) * (tail > 0)
        state.append((pool.get_state_buffer(layer_id), ring_rows))
        if entry.ratio == 4:
            state.append((pool.get_indexer_state_buffer(layer_id), ring_rows))
    # Sidecars (the canary's records) ride with the rows of their sub-pool.
    for sub, ratio in ((pool.c4_kv_pool, 4), (pool.c4_indexer_kv_pool, 4),
                       (pool.c128_kv_pool, 128)):  # fmt: skip
        rows = slots[::ratio].to(torch.int64) // ratio
        compressed += [(buf, rows) for buf in sub.extra_slot_buffers]
    for ratio, ring_pool in ((4, pool.compress_state_pools[4]),
                             (128, pool.compress_state_pools[128]),
                             (4, pool.indexer_compress_state_pool)):  # fmt: skip
        ring = STATE_RING_SIZE[ratio]
        tail = swa[-ring:].to(torch.int64)
        ring_rows = ((tail // pool.page_size) * ring + tail % ring) * (tail > 0)
        state += [(buf, ring_rows) for buf in ring_pool.extra_slot_buffers]
    return compressed, state


def _latent_rows(pool: DSV4KVPool) -> list[torch.Tensor]:
    """The SWA latent layer buffers, then their sidecars."""
    return pool.swa_kv_pool.buffers + pool.swa_kv_pool.extra_slot_buffers


def _save_rows(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    return [buf[rows].cpu() for buf, rows in parts]


def _get_dsv4_copy(pool: DSV4KVPool, slots: torch.Tensor) -> HostCopy:
    """One gather per buffer (latent rows are few: the window; compressed rows 1/ratio)."""
    swa = pool.full_to_swa_index_mapping[slots]
    mask = swa > 0
    compressed, state = _dsv4_parts(pool, slots, swa)
    return {
        "swa": [_save_rows([(buf, swa[mask])])[0] for buf in _latent_rows(pool)],
        "swa_mask": mask.cpu(),
        "compressed": _save_rows(compressed),
        "state": _save_rows(state),
    }


def _load_dsv4_copy(pool: DSV4KVPool, copy: HostCopy, slots: torch.Tensor) -> None:
    old_mask: torch.Tensor = copy["swa_mask"].to(slots.device)
    if old_mask.numel() != slots.numel():
        raise ValueError(f"load_cpu_copy: copy has {old_mask.numel()} indices, got {slots.numel()}")
    new_swa = pool.full_to_swa_index_mapping[slots]
    compressed, state = _dsv4_parts(pool, slots, new_swa)
    if len(copy["compressed"]) != len(compressed) or len(copy["state"]) != len(state):
        raise ValueError("load_cpu_copy: the copy's DSV4 sub-pools do not match the pool's layers")
    row_mask = (new_swa > 0)[old_mask]
    dest = new_swa[old_mask][row_mask]
    src_rows = torch.nonzero(row_mask).reshape(-1).cpu()
    if len(copy["swa"]) != len(_latent_rows(pool)):
        raise ValueError("load_cpu_copy: the copy's DSV4 latent buffers do not match the pool's")
    for cpu, buf in zip(copy["swa"], _latent_rows(pool), strict=True):
        buf[dest] = cpu[src_rows].to(buf.device)
    for cpu, (buf, rows) in zip(copy["compressed"], compressed, strict=True):
        buf[rows] = cpu.to(buf.device)
    # Ring rows only where the token had an SWA slot at save time and has one now.
    for cpu, (buf, rows) in zip(copy["state"], state, strict=True):
        keep = (rows > 0) & old_mask[-rows.numel() :]
        buf[rows[keep]] = cpu[keep.cpu()].to(buf.device)


def get_cpu_copy(
    pool: KVPool, indices: torch.Tensor, chunk_size: int | None = None
) -> HostCopy:
    """Copy the KV (and registered slot buffers) of full slots ``indices`` to the CPU."""
    chunk_size = DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size
    slots = _slots(pool, indices, chunk_size)
    if isinstance(pool, DSV4KVPool):
        return _get_dsv4_copy(pool, slots)
    if isinstance(pool, SWAKVPool):
        swa = pool.full_to_swa_index_mapping[slots]
        mask = swa > 0
        return {
            "full": _save(pool.full_kv_pool, slots, chunk_size),
            "swa": _save(pool.swa_kv_pool, swa[mask], chunk_size),
            "swa_mask": mask.cpu(),
        }
    if isinstance(pool, MHAKVPool):
        return {"full": _save(pool, slots, chunk_size)}
    raise _unsupported(pool)


def load_cpu_copy(
    pool: KVPool,
    copy: HostCopy,
    indices: torch.Tensor,
    chunk_size: int | None = None,
) -> None:
    """Restore ``copy`` into full slots ``indices`` (same length as the saved indices).

    Everything is validated before the first write, so a mismatched copy loads nothing.
    """
    chunk_size = DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size
    slots = _slots(pool, indices, chunk_size)
    if isinstance(pool, MHAKVPool):
        _check_rows(pool, copy["full"], slots.numel(), "full")
        _load(pool, copy["full"], slots, None, chunk_size)
        return
    if isinstance(pool, DSV4KVPool):
        _load_dsv4_copy(pool, copy, slots)
        return
    if not isinstance(pool, SWAKVPool):
        raise _unsupported(pool)
    old_mask: torch.Tensor = copy["swa_mask"].to(slots.device)
    if old_mask.numel() != slots.numel():
        raise ValueError(f"load_cpu_copy: copy has {old_mask.numel()} indices, got {slots.numel()}")
    _check_rows(pool.full_kv_pool, copy["full"], slots.numel(), "full")
    _check_rows(pool.swa_kv_pool, copy["swa"], int(old_mask.sum()), "swa")
    _load(pool.full_kv_pool, copy["full"], slots, None, chunk_size)
    new_swa = pool.full_to_swa_index_mapping[slots]
    row_mask = (new_swa > 0)[old_mask]
    dest = new_swa[old_mask][row_mask]
    if dest.numel():
        src_rows = torch.nonzero(row_mask.cpu()).reshape(-1)
        _load(pool.swa_kv_pool, copy["swa"], dest, src_rows, chunk_size)
