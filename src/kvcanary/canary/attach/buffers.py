"""Canary buffer groups: the records of one attention regime ("pool kind") of a KV pool.

A group owns separate HEAD and TAIL buffers (``uint8 [num_slots, 32]`` each, row ``s`` =
slot ``s`` of the group's sub-pool) for the K half, and for the V half when the pool has
one. HEAD is written before the forward (no real-KV field: the KV does not exist yet),
TAIL after it (with the fingerprint of the KV attention just wrote), so each stage keeps an
independent copy of every request's hash chain and neither overwrites the other::

    group (kind, sub-pool)        k_head  k_tail  [v_head  v_tail]   32 B per slot each
      slot index space            the sub-pool's own rows; full slots are translated
                                  through ``swa_index_lut`` (SWA: the full->SWA mapping;
                                  compressed kinds: full slot // compression_ratio;
                                  state kinds: ring rows, :mod:`.state_plan`)

Buffers are allocated zeroed (slot 0 = reserved padding, never verified) and owned by the
group; the pool only carries them along (host copies, buf-info transfers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcanary.canary.plan.state import StateRing
from kvcanary.canary.wire.constants import (
    MAX_REAL_KV_SOURCES,
    REAL_KV_BYTE_ALIGNMENT,
    CanaryLaunchTag,
    KvHalf,
    LaunchStage,
    PoolKind,
    RealKvHashMode,
    launch_tag,
)
from kvcanary.canary.wire.real_kv import RealKvSource, resolve_read_bytes
from kvcanary.canary.wire.records import alloc_canary_buffer


@dataclass(frozen=True, eq=False)
class CanaryBufferGroup:
    kind: PoolKind
    sub_pool: str  # where the group's slots live, for messages ("swa_kv_pool", ...)
    page_size: int  # slots per page of the sub-pool: a buf-info item is 32 * page_size bytes
    k_head: torch.Tensor
    k_tail: torch.Tensor
    v_head: torch.Tensor | None = None
    v_tail: torch.Tensor | None = None
    real_kv_sources_k: tuple[RealKvSource, ...] = ()
    real_kv_sources_v: tuple[RealKvSource, ...] = ()
    # Full slot -> group slot (0 = not resident). None: the group indexes full slots.
    swa_index_lut: torch.Tensor | None = None
    window: int | None = None  # SWA kinds: only the last `window` positions are verified
    # SWA kinds: attention also reads position prefix_len - window (SGLang: a query at q
    # sees keys q - window .. q), so a hole there is a violation too (the residency check).
    reads_window_start: bool = False
    # > 1: one record per `compression_ratio` consecutive positions (DSV4 C4/C128/indexer);
    # record position = block index, token = the block's last token.
    compression_ratio: int = 1
    kv_token_id_vs_position_offset: int = 0  # 1 for draft pools (slot p holds token p + 1)
    # Compress-state kinds: the ring layout (one record per ring row; planned by
    # :mod:`.state_plan`, ``swa_index_lut`` = the full->SWA mapping for swa_page rings).
    state_ring: StateRing | None = None

    @property
    def num_slots(self) -> int:
        return int(self.k_head.shape[0])

    @property
    def has_v_half(self) -> bool:
        return self.v_head is not None

    def halves(self, v_half: bool) -> tuple[KvHalf, ...]:
        """The halves launched: K, plus V when the group has one and ``v_half`` is on."""
        return (KvHalf.K, KvHalf.V) if v_half and self.has_v_half else (KvHalf.K,)

    @property
    def sweepable(self) -> bool:
        """Compressed groups summarise blocks of positions and state rings hold only a live
        tail; a radix sweep covers the others."""
        return self.per_position

    @property
    def residency_check(self) -> int:
        """The planners' ``check_residency``: 0 off (compressed groups, state rings), 1 holes
        from ``prefix_len - window + 1``, 2 from ``prefix_len - window``
        (:attr:`reads_window_start`)."""
        if not self.per_position:
            return 0
        return 2 if self.reads_window_start else 1

    @property
    def per_position(self) -> bool:
        """One record per position of the request's history (FULL, SWA): row-planned on the
        CPU, residency-checked, store-checked."""
        return self.compression_ratio == 1 and self.state_ring is None

    def launch_tags(self, stages: Sequence[LaunchStage], v_half: bool) -> list[CanaryLaunchTag]:
        """The tags this group launches in ``stages`` (K, plus V when launched)."""
        return [launch_tag(self.kind, s, h) for s in stages for h in self.halves(v_half)]

    def records(self, stage: LaunchStage, half: KvHalf) -> torch.Tensor:
        bufs = {
            (LaunchStage.HEAD, KvHalf.K): self.k_head,
            (LaunchStage.TAIL, KvHalf.K): self.k_tail,
            (LaunchStage.HEAD, KvHalf.V): self.v_head,
            (LaunchStage.TAIL, KvHalf.V): self.v_tail,
        }
        buf = bufs.get((stage, half))
        if buf is None:
            raise ValueError(f"canary group {self.kind.name} has no {stage.name} {half.name} buffer")
        return buf

    def real_kv_sources(self, stage: LaunchStage, half: KvHalf) -> tuple[RealKvSource, ...]:
        """HEAD never fingerprints (the KV of this forward's tokens is not written yet)."""
        if stage == LaunchStage.HEAD:
            return ()
        return self.real_kv_sources_k if half == KvHalf.K else self.real_kv_sources_v

    def buffers(self) -> list[torch.Tensor]:
        """Every record buffer, in sidecar-registration order (K head, K tail, V head, V tail)."""
        bufs = [self.k_head, self.k_tail, self.v_head, self.v_tail]
        return [b for b in bufs if b is not None]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers())


def allocate_group(
    kind: PoolKind,
    *,
    sub_pool: str,
    num_slots: int,
    page_size: int,
    device: torch.device,
    with_v: bool,
    **extra: object,
) -> CanaryBufferGroup:
    """A group with zeroed HEAD/TAIL record buffers of ``num_slots`` rows (K, and V if asked)."""
    if num_slots < 2:
        raise ValueError(
            f"kv-canary: sub-pool {sub_pool!r} has {num_slots} slot(s); it needs at least one "
            "slot beyond the reserved slot 0"
        )

    def alloc() -> torch.Tensor:
        return alloc_canary_buffer(num_slots, device)

    return CanaryBufferGroup(
        kind, sub_pool, page_size, alloc(), alloc(),
        alloc() if with_v else None, alloc() if with_v else None,
        **extra,  # type: ignore[arg-type]
    )  # fmt: skip


def real_kv_sources(
    layer_buffers: Sequence[torch.Tensor],
    mode: RealKvHashMode,
    layers: str,
    what: str,
) -> tuple[RealKvSource, ...]:
    """Sources over the live layer buffers of one half of a sub-pool (row ``s`` = slot ``s``).

    ``layers``: ``first`` (layer 0, SGLang's choice) or ``all``. Raises ``ValueError`` when
    the layout cannot be fingerprinted (row bytes not a multiple of 16, > 4 layers).
    """
    if mode == RealKvHashMode.NONE or not layer_buffers:
        return ()
    chosen = list(layer_buffers[:1] if layers == "first" else layer_buffers)
    if len(chosen) > MAX_REAL_KV_SOURCES:
        raise ValueError(
            f"--kv-canary-real-data-layers=all: {what} has {len(chosen)} layers; allowed at most "
            f"{MAX_REAL_KV_SOURCES} fingerprinted layers per half (use 'first')"
        )
    sources = []
    for buf in chosen:
        if not buf.is_contiguous():
            raise ValueError(f"kv-canary: {what} layer buffer is not contiguous; cannot fingerprint")
        rows = buf.view(buf.shape[0], -1).view(torch.uint8)  # a view of the live pool, not a copy
        row_bytes = rows.shape[1]
        if row_bytes % REAL_KV_BYTE_ALIGNMENT:
            raise ValueError(
                f"--kv-canary-real-data={mode.name.lower()}: {what} holds {row_bytes} bytes per "
                f"slot; allowed: multiples of {REAL_KV_BYTE_ALIGNMENT} (use 'none')"
            )
        sources.append(RealKvSource(rows, 1, row_bytes, resolve_read_bytes(mode, row_bytes)))
    return tuple(sources)
