"""vLLM's KV cache groups as canary pools: one :class:`VllmGroupPool` a group, attached by
the canary's registry (:func:`~kvcanary.canary.attach.registry.register_pool_attacher`).

Records: one set of HEAD/TAIL record buffers per block size, shared by every group of
that block size. vLLM allocates all groups' blocks from one block pool over one storage,
so a block holds one group's KV at a time and its records describe whoever wrote it last:
a block reused by any group while still in some request's window is caught by that
request's next verify.

Real KV (record field 3) of a layer tensor:

    CPU layout  [num_blocks, kv_heads, block_size, 2 * head_size]: per (block, head) K is
                stored transposed [head_size, block_size], then V [block_size, head_size]:

                    block row: | head 0: K^T                     | V            | head 1 ...
                               | d0: t0 t1 .. tbs-1 | d1: t0 .. | t0: d0 .. dhs-1 | ...

                the K records fingerprint K of KV head 0 (a strided source: a token's
                head_size elements block_size elements apart), the V records (v_half) V of
                the last KV head (contiguous). vLLM's CPU attention lays KV out this way
                for its ISAs "vec" and "vec16" with a float KV cache (GroupSpec.cpu_attn_isa);
                under others (AMX packs bf16 K in pairs of elements across 16-token groups,
                and V too; an fp8 cache) the canary keeps records only (a warning says so).
    NHD layout  [2, num_blocks, block_size, kv_heads, head_size] (GPU flash-attention):
                K records fingerprint the token's K row (all heads), V records its V row.
    other       records only (a warning says so).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcanary.canary.attach.buffers import CanaryBufferGroup
from kvcanary.canary.attach.registry import AttachOptions, register_pool_attacher
from kvcanary.canary.attach.splice import BufInfos
from kvcanary.canary.wire.constants import MAX_REAL_KV_SOURCES, RealKvHashMode
from kvcanary.canary.wire.real_kv import RealKvSource, resolve_read_bytes
from kvcanary.canary.wire.records import alloc_canary_buffer
from kvcanary.integrations.vllm.meta import GroupSpec

logger = logging.getLogger("kvcanary.canary")


@dataclass(frozen=True)
class SharedRecords:
    """HEAD/TAIL record buffers over ``num_slots`` slots (V half only with ``with_v``)."""

    k_head: torch.Tensor
    k_tail: torch.Tensor
    v_head: torch.Tensor | None
    v_tail: torch.Tensor | None

    @staticmethod
    def allocate(num_slots: int, device: torch.device, with_v: bool) -> SharedRecords:
        def a() -> torch.Tensor:
            return alloc_canary_buffer(num_slots, device)

        return SharedRecords(a(), a(), a() if with_v else None, a() if with_v else None)

    @property
    def num_slots(self) -> int:
        return int(self.k_head.shape[0])


class VllmGroupPool:
    """The :class:`~kvcanary.canary.host.KVPool` of one vLLM KV cache group."""

    def __init__(self, spec: GroupSpec, layers: Sequence[torch.Tensor], records: SharedRecords):
        self.spec = spec
        self.layers = list(layers)
        self.records = records

    def get_contiguous_buf_infos(self) -> BufInfos:
        """vLLM ships KV through its own connectors, never by these; given for the protocol."""
        ptrs = [t.data_ptr() for t in self.layers]
        lens = [t.nbytes for t in self.layers]
        items = [t.nbytes // max(1, self.records.num_slots // self.spec.block_size)
                 for t in self.layers]  # fmt: skip
        return ptrs, lens, items

    def get_state_buf_infos(self) -> BufInfos:
        return [], [], []


# vLLM's CPU attention ISAs that store K as [head_size, block_size] and V as [block_size,
# head_size] per (block, head) (csrc/cpu/cpu_attn_vec.hpp, reshape_and_cache; vec16
# inherits it), for these KV cache dtypes (an fp8 cache is stored by another routine).
_PLAIN_CPU_ISAS = ("vec", "vec16")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def layer_sources(kv: torch.Tensor, spec: GroupSpec, mode: RealKvHashMode,
                  ) -> tuple[RealKvSource | None, RealKvSource | None]:  # fmt: skip
    """(K-records source, V-records source) of one layer tensor (module doc), or Nones."""
    if mode == RealKvHashMode.NONE or not kv.is_contiguous():
        return None, None
    es, bs, hs, heads = kv.element_size(), spec.block_size, spec.head_size, spec.num_kv_heads
    if kv.dim() == 4 and tuple(kv.shape[1:]) == (heads, bs, 2 * hs):  # CPU layout
        if spec.cpu_attn_isa not in _PLAIN_CPU_ISAS or kv.dtype not in _FLOAT_DTYPES:
            logger.warning(
                "kv-canary (vLLM): group %d's KV is laid out for vLLM's CPU attention ISA %r "
                "(KV cache dtype %s), not the layout the canary can fingerprint (ISA vec or "
                "vec16, float KV); records only (no real-KV check)",
                spec.index, spec.cpu_attn_isa, kv.dtype,
            )  # fmt: skip
            return None, None
        nb, read = kv.shape[0], resolve_read_bytes(mode, hs * es)
        rows = kv.view(nb, -1).view(torch.uint8)
        k_view = rows[:, : hs * bs * es]  # head 0's K^T: element d of token t at (d*bs + t)*es
        k = RealKvSource(k_view, bs, es, read, element_size=es, element_stride=bs * es)
        off = ((heads - 1) * bs * 2 * hs + hs * bs) * es  # the last head's V
        v = RealKvSource(rows[:, off : off + bs * hs * es], bs, hs * es, read)
        return k, v
    if kv.dim() == 5 and kv.shape[0] == 2 and tuple(kv.shape[2:]) == (bs, heads, hs):  # NHD
        nb, per_token = kv.shape[1], heads * hs * es

        def half(i: int) -> RealKvSource:
            view = kv[i].reshape(nb, -1).view(torch.uint8)
            return RealKvSource(view, bs, per_token, resolve_read_bytes(mode, per_token))

        return half(0), half(1)
    logger.warning(
        "kv-canary (vLLM): KV cache layout %s of group %d is not one the canary can "
        "fingerprint; records only (no real-KV check)", tuple(kv.shape), spec.index,
    )  # fmt: skip
    return None, None


def _attach_vllm_group(pool: VllmGroupPool, options: AttachOptions) -> list[CanaryBufferGroup]:
    spec, rec = pool.spec, pool.records
    chosen = pool.layers[:1] if options.real_data_layers == "first" else pool.layers
    chosen = chosen[:MAX_REAL_KV_SOURCES]
    pairs = [layer_sources(kv, spec, options.real_kv_mode) for kv in chosen]
    k_src = tuple(k for k, _ in pairs if k is not None)
    v_src = tuple(v for _, v in pairs if v is not None)
    group = CanaryBufferGroup(
        spec.kind, f"vllm_kv_cache_group_{spec.index}", spec.block_size,
        rec.k_head, rec.k_tail, rec.v_head, rec.v_tail,
        real_kv_sources_k=k_src, real_kv_sources_v=v_src if rec.v_head is not None else (),
        window=spec.sliding_window,
    )  # fmt: skip
    return [group]


register_pool_attacher(VllmGroupPool, _attach_vllm_group)
