"""A small serving loop over SGLang's real pools, allocators and store methods, with
kvcanary's canary installed on them (``kvcanary.integrations.sglang``).

``Serving`` owns SGLang's ``ReqToTokenPool``, a pool, the allocator SGLang pairs with it,
and the canary. ``forward([(req, n), ...])`` is one SGLang-shaped forward: slots from
SGLang's allocator (``alloc`` at page size 1, ``alloc_extend`` / ``alloc_decode`` above),
req->token rows written as SGLang's scheduler writes them, a ``ForwardBatch`` (SGLang's own
class) with the mode's fields, then ``before_forward`` -> the pool's own store methods for
every layer -> ``after_forward``. Finished requests free their slots (``allocator.free``),
so later requests reuse them; SWA pools evict the window's tail (``free_swa``) as SGLang does.

DeepSeek-V4 stores: SGLang's ``set_swa_key_buffer`` / ``set_extra_key_buffer`` /
``set_index_k_scale_buffer`` run as released, down to their Triton kernels, which cannot run
on a CPU (Triton is a placeholder here); :func:`install_dsv4_store_kernels` replaces the two
Triton kernel objects by torch ports of their bodies (same byte offsets), so the pool's own
Python store path, with its asserts, does the rest.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from kvcanary.canary.config import CanaryConfig
from kvcanary.integrations.sglang import SGLangForwardBatchView, install_on_sglang

DEVICE = "cpu"


@dataclass
class Req:
    rid: int
    row: int
    tokens: list[int]
    kv_len: int = 0
    slots: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.kv_len >= len(self.tokens)


class Serving:
    """One canary-protected SGLang pool driven forward by forward (module doc)."""

    def __init__(self, pool: Any, allocator: Any, *, page_size: int, config: CanaryConfig,
                 window: int | None = None, max_reqs: int = 8, max_context: int = 512,
                 seed: int = 0, install: bool = True):  # fmt: skip
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        self.pool, self.allocator, self.page_size = pool, allocator, page_size
        self.window = window
        self.r2t = ReqToTokenPool(size=max_reqs, max_context_len=max_context, device=DEVICE,
                                  enable_memory_saver=False)  # fmt: skip
        self.gen = torch.Generator().manual_seed(seed)
        self.rids = itertools.count()
        self.forwards = 0
        self.canary = (
            install_on_sglang(pool, self.r2t, config, sliding_window=window) if install else None
        )
        self.last_batch: Any = None

    # ------------------------------------------------------------------ requests
    def new_request(self, length: int) -> Req:
        (row,) = self.r2t.alloc_rows(1)
        tokens = torch.randint(1, 30000, (length,), generator=self.gen).tolist()
        return Req(next(self.rids), row, tokens)

    def finish(self, req: Req) -> None:
        if req.slots:
            self.allocator.free(torch.tensor(req.slots, dtype=torch.int64))
        self.r2t.free_slots.append(req.row)
        self.r2t.req_to_token[req.row].zero_()
        req.slots = []

    # ------------------------------------------------------------------ one forward
    def _alloc(self, work: list[tuple[Req, int]], decode: bool) -> torch.Tensor:
        total = sum(n for _, n in work)
        if self.page_size == 1:
            out = self.allocator.alloc(total)
        else:
            prefix = torch.tensor([r.kv_len for r, _ in work], dtype=torch.int64)
            seq = prefix + torch.tensor([n for _, n in work], dtype=torch.int64)
            last = torch.tensor([r.slots[-1] if r.slots else -1 for r, _ in work],
                                dtype=torch.int64)  # fmt: skip
            if decode:
                out = self.allocator.alloc_decode(seq, seq.clone(), last)
            else:
                out = self.allocator.alloc_extend(prefix, prefix.clone(), seq, seq.clone(),
                                                  last, total)  # fmt: skip
        assert out is not None, "SGLang's allocator is out of slots"
        return out.to(torch.int64)

    def forward(self, work: list[tuple[Req, int]], *, store: bool = True) -> Any:
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        decode = all(n == 1 and r.kv_len > 0 for r, n in work)
        loc = self._alloc(work, decode)
        ids, pos, start = [], [], 0
        for r, n in work:
            new = loc[start : start + n]
            self.r2t.req_to_token[r.row, r.kv_len : r.kv_len + n] = new.to(torch.int32)
            r.slots += new.tolist()
            ids += r.tokens[r.kv_len : r.kv_len + n]
            pos += range(r.kv_len, r.kv_len + n)
            start += n
        prefix = torch.tensor([r.kv_len for r, _ in work], dtype=torch.int64)
        extend = torch.tensor([n for _, n in work], dtype=torch.int64)
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            batch_size=len(work), input_ids=torch.tensor(ids, dtype=torch.int64),
            req_pool_indices=torch.tensor([r.row for r, _ in work], dtype=torch.int64),
            seq_lens=prefix + extend, out_cache_loc=loc, seq_lens_sum=int((prefix + extend).sum()),
            positions=torch.tensor(pos, dtype=torch.int64),
            extend_prefix_lens=None if decode else prefix,
            extend_seq_lens=None if decode else extend,
        )  # fmt: skip
        view = SGLangForwardBatchView(fb)
        if self.canary is not None:
            self.canary.before_forward(view)
        if store:
            self.store(fb)
        if self.canary is not None:
            self.canary.after_forward(view)
        for r, n in work:
            r.kv_len += n
        self.forwards += 1
        self.last_batch = fb
        self.evict(work)
        return fb

    def store(self, fb: Any) -> None:
        raise NotImplementedError

    def evict(self, work: list[tuple[Req, int]]) -> None:
        pass

    def kv(self, n: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(n, *shape, generator=self.gen).to(dtype)

    # ------------------------------------------------------------------ a session
    def run_session(self, *, num_reqs: int = 3, chunk: int = 7, decode_steps: int = 6,
                    lengths: tuple[int, ...] = (9, 13, 5)) -> list[Req]:  # fmt: skip
        """Prefill (one request chunked), decode, finish one, admit another (slot reuse)."""
        reqs = [self.new_request(lengths[i % len(lengths)] + decode_steps)
                for i in range(num_reqs)]  # fmt: skip
        plen = [lengths[i % len(lengths)] for i in range(num_reqs)]
        # chunked prefill of request 1 beside whole prefills
        self.forward([(reqs[0], plen[0]), (reqs[1], min(chunk, plen[1]))])
        rest = [(reqs[1], plen[1] - min(chunk, plen[1]))] if plen[1] > chunk else []
        self.forward(rest + [(r, p) for r, p in zip(reqs[2:], plen[2:], strict=True)])
        for _ in range(decode_steps):
            self.forward([(r, 1) for r in reqs if not r.done])
        self.finish(reqs[0])
        late = self.new_request(lengths[0] + 3)
        self.forward([(late, lengths[0])])
        for _ in range(3):
            self.forward([(r, 1) for r in [*reqs[1:], late] if not r.done])
        return [*reqs[1:], late]


# ---------------------------------------------------------------------- MHA / SWA


def layer(layer_id: int) -> Any:
    """What SGLang's ``set_kv_buffer`` reads of a ``RadixAttention`` layer."""
    return SimpleNamespace(layer_id=layer_id, is_cross_attention=False)


class MHAServing(Serving):
    """``MHATokenToKVPool`` + ``TokenToKVPoolAllocator`` / ``PagedTokenToKVPoolAllocator``."""

    @classmethod
    def make(cls, *, page_size: int, config: CanaryConfig, layers: int = 2, size: int = 256,
             **kw: Any) -> MHAServing:  # fmt: skip
        from sglang.srt.mem_cache.allocator import (
            PagedTokenToKVPoolAllocator,
            TokenToKVPoolAllocator,
        )
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        pool = MHATokenToKVPool(size=size, page_size=page_size, dtype=torch.float16, head_num=2,
                                head_dim=8, layer_num=layers, device=DEVICE,
                                enable_memory_saver=False)  # fmt: skip
        if page_size == 1:
            alloc = TokenToKVPoolAllocator(size, torch.float16, DEVICE, pool, False)
        else:
            alloc = PagedTokenToKVPoolAllocator(size, page_size, torch.float16, DEVICE, pool, False)
        return cls(pool, alloc, page_size=page_size, config=config, **kw)

    def store(self, fb: Any) -> None:
        n = int(fb.out_cache_loc.shape[0])
        for lid in range(self.pool.layer_num):
            # float32 in: SGLang casts to the pool's dtype inside set_kv_buffer
            self.pool.set_kv_buffer(
                layer(lid), fb.out_cache_loc, self.kv(n, 2, 8), self.kv(n, 2, 8)
            )


class SWAServing(Serving):
    """``SWAKVPool`` + SGLang's ``SWATokenToKVPoolAllocator`` (which registers the
    full->SWA mapping); ``pure=True``: every layer slides (``PureSWATokenToKVPoolAllocator``,
    identity mapping, a layerless full sub-pool)."""

    @classmethod
    def make(cls, *, page_size: int, config: CanaryConfig, window: int = 4, pure: bool = False,
             size: int = 256, size_swa: int = 128, **kw: Any) -> SWAServing:  # fmt: skip
        from sglang.srt.mem_cache.allocator.swa import (
            PureSWATokenToKVPoolAllocator,
            SWATokenToKVPoolAllocator,
        )
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        swa_ids, full_ids = ([0, 1, 2], []) if pure else ([0, 2], [1, 3])
        if pure:
            size_swa = size
        pool = SWAKVPool(size=size, size_swa=size_swa, page_size=page_size, dtype=torch.float16,
                         head_num=2, head_dim=8, swa_attention_layer_ids=swa_ids,
                         full_attention_layer_ids=full_ids, device=DEVICE,
                         enable_memory_saver=False)  # fmt: skip
        common = dict(
            size_swa=size_swa,
            page_size=page_size,
            dtype=torch.float16,
            device=DEVICE,
            kvcache=pool,
            need_sort=False,
        )
        alloc = (PureSWATokenToKVPoolAllocator(**common) if pure
                 else SWATokenToKVPoolAllocator(size=size, **common))  # fmt: skip
        return cls(pool, alloc, page_size=page_size, config=config, window=window, **kw)

    def store(self, fb: Any) -> None:
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        n = int(fb.out_cache_loc.shape[0])
        swa_loc = self.pool.translate_loc_from_full_to_swa(fb.out_cache_loc)
        write = KVWriteLoc(fb.out_cache_loc, swa_loc=swa_loc, physical=True)
        for lid in sorted(self.pool.layers_mapping):
            self.pool.set_kv_buffer(layer(lid), write, self.kv(n, 2, 8), self.kv(n, 2, 8))

    def evict(self, work: list[tuple[Req, int]]) -> None:
        """Free the SWA peers of whole pages that ended before ``kv_len - window`` (what
        attention and the canary still read stays resident)."""
        assert self.window is not None
        if type(self.allocator).__name__ == "PureSWATokenToKVPoolAllocator":
            return  # identity mapping: the full and SWA slots are the same slots
        for r, _ in work:
            keep_from = max(0, r.kv_len - self.window) // self.page_size * self.page_size
            old = getattr(r, "swa_evicted", 0)
            if keep_from > old:
                self.allocator.free_swa(torch.tensor(r.slots[old:keep_from], dtype=torch.int64))
                r.swa_evicted = keep_from  # type: ignore[attr-defined]

    def finish(self, req: Req) -> None:
        old = getattr(req, "swa_evicted", 0)
        if req.slots:
            self.allocator.free_full(torch.tensor(req.slots[:old], dtype=torch.int64))
            self.allocator.free(torch.tensor(req.slots[old:], dtype=torch.int64))
        self.r2t.free_slots.append(req.row)
        self.r2t.req_to_token[req.row].zero_()
        req.slots = []


# ---------------------------------------------------------------------- DeepSeek-V4


class _Launch:
    """``kernel[grid](*args, **meta)`` for a torch function (the grid is implied)."""

    def __init__(self, fn: Any):
        self.fn = fn

    def __getitem__(self, grid: Any) -> Any:
        return self.fn


def _dsv4_main_kv_store(buf_fp8: Any, buf_bf16: Any, buf_uint8: torch.Tensor, loc: torch.Tensor,
                        k_nope: torch.Tensor, k_rope: torch.Tensor, scale: torch.Tensor,
                        *strides: int, PAGE_SIZE: int, BUF_NUMEL_PER_PAGE: int,
                        NUM_NOPE_ELEMS_PER_TOKEN: int, NUM_NOPE_ROPE_BYTES_PER_TOKEN: int,
                        NUM_SCALE_ELEMS_PER_TOKEN: int, PADDED_SCALE_ELEMS_PER_TOKEN: int,
                        S_OFFSET_NBYTES_IN_PAGE: int, **_: Any) -> None:  # fmt: skip
    """Torch port of ``dsv4_main_kv_store._set_k_and_s_triton_kernel``: token ``t`` -> page
    ``loc // P``: nope fp8 at ``(loc % P) * 576``, rope bf16 right after, scales at
    ``P * 576 + (loc % P) * 8``."""
    flat = buf_uint8.view(-1)
    nope, data = NUM_NOPE_ELEMS_PER_TOKEN, NUM_NOPE_ROPE_BYTES_PER_TOKEN
    for t, s in enumerate(loc.tolist()):
        page, off = divmod(s, PAGE_SIZE)
        base = page * BUF_NUMEL_PER_PAGE + off * data
        flat[base : base + nope] = k_nope[t].view(torch.uint8)
        flat[base + nope : base + data] = k_rope[t].contiguous().view(torch.uint8)
        at = (
            page * BUF_NUMEL_PER_PAGE + S_OFFSET_NBYTES_IN_PAGE + off * PADDED_SCALE_ELEMS_PER_TOKEN
        )
        flat[at : at + NUM_SCALE_ELEMS_PER_TOKEN] = scale[t, :NUM_SCALE_ELEMS_PER_TOKEN]


def _dsv4_index_k_store(buf_fp8: torch.Tensor, buf_fp32: Any, loc: torch.Tensor,
                        index_k: torch.Tensor, index_k_scale: torch.Tensor, stride: int, *,
                        PAGE_SIZE: int, BUF_NUMEL_PER_PAGE: int, NUM_K_ELEMS_PER_TOKEN: int,
                        S_OFFSET_NBYTES_IN_PAGE: int, PRESHUFFLE_TILE: int) -> None:  # fmt: skip
    """Torch port of ``dsa_index_k_cache._set_k_and_s_triton_kernel`` (no preshuffle):
    k fp8 at ``page * B + (loc % P) * 128``, the fp32 scale at ``page * B + P * 128 +
    (loc % P) * 4``."""
    assert not PRESHUFFLE_TILE
    flat = buf_fp8.view(torch.uint8).view(-1)
    for t, s in enumerate(loc.tolist()):
        page, off = divmod(s, PAGE_SIZE)
        base = page * BUF_NUMEL_PER_PAGE + off * NUM_K_ELEMS_PER_TOKEN
        flat[base : base + NUM_K_ELEMS_PER_TOKEN] = index_k[t].view(torch.uint8)
        at = page * BUF_NUMEL_PER_PAGE + S_OFFSET_NBYTES_IN_PAGE + off * 4
        flat[at : at + 4] = index_k_scale.reshape(-1)[t : t + 1].view(torch.uint8)


def install_dsv4_store_kernels() -> None:
    """SGLang's DSV4 server-args context on CPU, and torch ports of its two store kernels."""
    from sglang.kernels.ops.kvcache import dsa_index_k_cache, dsv4_main_kv_store
    from sglang.srt.runtime_context import get_context

    get_context().override_server_args(device="cpu").install()
    dsv4_main_kv_store._set_k_and_s_triton_kernel = _Launch(_dsv4_main_kv_store)
    dsa_index_k_cache._set_k_and_s_triton_kernel = _Launch(_dsv4_index_k_store)


DSV4_RATIOS = (0, 4, 128, 4, 0)  # layers: SWA only, C4 (+ indexer), C128, C4, SWA only


class DSV4Serving(Serving):
    """``DeepSeekV4TokenToKVPool`` (page 256, V4 layout) + SGLang's
    ``SWATokenToKVPoolAllocator`` (its full side is the token space the compressed pools
    are indexed by, full slot // ratio). Per layer: the SWA latent through
    ``set_swa_key_buffer`` (SWA slots); compressed layers, for every block of ``ratio``
    positions the forward completes, one compressed row through ``set_extra_key_buffer``
    and (C4) one indexer row through ``set_index_k_scale_buffer``; and each token's raw
    compressor state (kv, score) into its ring row through SGLang's own
    ``translate_from_swa_loc_to_state_loc`` (C4 and indexer rings, per SWA page) /
    ``translate_from_req_position_to_state_loc`` (C128, per request) and
    ``set_state_by_state_loc``, as its compressors do: a request's last ``ring_size`` tokens
    of the forward (earlier ones would be overwritten within the forward anyway)."""

    @classmethod
    def make(cls, *, config: CanaryConfig, window: int = 128, full: int = 2048,
             swa: int = 1536, **kw: Any) -> DSV4Serving:  # fmt: skip
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

        install_dsv4_store_kernels()
        page = 256
        pool = DeepSeekV4TokenToKVPool(
            max_num_reqs=4, swa_size=swa, c4_size=full // 4, c128_size=full // 128,
            # the C4 rings are addressed per SWA page (SGLang's pool configurator: swa tokens
            # // page * ring); C128's are request-scoped and sized from max_num_reqs
            c4_state_pool_size=swa // page * 8, c128_state_pool_size=0, page_size=page,
            swa_page_size=page,
            dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32,
            c128_state_dtype=torch.float32, qk_nope_head_dim=448, qk_rope_head_dim=64,
            indexer_head_dim=128, layer_num=len(DSV4_RATIOS), device=DEVICE,
            enable_memory_saver=False, compression_ratios=list(DSV4_RATIOS), full_size=full,
            sliding_window=window,
        )  # fmt: skip
        alloc = SWATokenToKVPoolAllocator(size=full, size_swa=swa, page_size=page,
                                          dtype=torch.float8_e4m3fn, device=DEVICE,
                                          kvcache=pool, need_sort=False)  # fmt: skip
        kw.setdefault("max_context", 1024)
        kw["max_reqs"] = pool.num_req_slots - 1  # the request-scoped rings cover these rows
        return cls(pool, alloc, page_size=page, config=config, window=window, **kw)

    def pack(self, n: int) -> Any:
        from sglang.kernels.ops.kvcache.dsv4_main_kv_store import NopeFp8RopeBf16Pack

        return NopeFp8RopeBf16Pack(
            k_nope_fp8=self.kv(n, 448, dtype=torch.float8_e4m3fn),
            k_rope_bf16=self.kv(n, 64, dtype=torch.bfloat16),
            scale_k_nope_ue8m0=torch.randint(100, 140, (n, 7), generator=self.gen).to(torch.uint8),
        )  # fmt: skip

    def store(self, fb: Any) -> None:
        n = int(fb.out_cache_loc.shape[0])
        swa_loc = self.pool.translate_loc_from_full_to_swa(fb.out_cache_loc)
        positions = fb.positions.tolist()
        for lid, ratio in enumerate(DSV4_RATIOS):
            self.pool.set_swa_key_buffer(lid, swa_loc, self.pack(n))
            if ratio == 0:
                continue
            self.store_states(fb, lid, swa_loc)
            # the tokens that complete a block: its compressed row (full slot // ratio)
            done = [i for i, p in enumerate(positions) if p % ratio == ratio - 1]
            if not done:
                continue
            cloc = fb.out_cache_loc[done] // ratio
            self.pool.set_extra_key_buffer(lid, cloc, self.pack(len(done)))
            if ratio == 4:
                self.pool.set_index_k_scale_buffer(
                    lid,
                    cloc,
                    self.kv(len(done), 128, dtype=torch.float8_e4m3fn),
                    torch.rand(len(done), 1, generator=self.gen),
                )

    def store_states(self, fb: Any, lid: int, swa_loc: torch.Tensor) -> None:
        from sglang.srt.mem_cache.deepseek_v4_compress_state import KVAndScore

        req = torch.repeat_interleave(fb.req_pool_indices, self.extend_lens(fb))
        states = [self.pool.get_attention_compress_states(lid)]
        if DSV4_RATIOS[lid] == 4:
            states.append(self.pool.get_indexer_compress_states(lid))
        for state in states:
            # the last ring_size tokens of each request in this forward (distinct rows)
            keep = torch.ones_like(req, dtype=torch.bool)
            ring = state.ring_size
            if req.shape[0] > ring:
                keep[:-ring] = req[:-ring] != req[ring:]
            if state.request_scoped:
                loc = state.translate_from_req_position_to_state_loc(req, fb.positions.clone())
            else:
                loc = state.translate_from_swa_loc_to_state_loc(swa_loc.clone())
            half = state.kv_score_buffer.kv_score.shape[1] // 2
            value = KVAndScore.from_kv_score(kv=self.kv(int(keep.sum()), half),
                                             score=self.kv(int(keep.sum()), half))  # fmt: skip
            state.set_state_by_state_loc(loc[keep], value)

    @staticmethod
    def extend_lens(fb: Any) -> torch.Tensor:
        if fb.extend_seq_lens is not None:
            return fb.extend_seq_lens
        return torch.ones_like(fb.req_pool_indices)

    def evict(self, work: list[tuple[Req, int]]) -> None:
        SWAServing.evict(self, work)  # type: ignore[arg-type]

    def finish(self, req: Req) -> None:
        SWAServing.finish(self, req)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- SGLang's own canary


def _phase_check(phase: torch.Tensor, enable_assert: torch.Tensor, *, EXPECT_PHASE: int,
                 NEXT_PHASE: int, CALLER_TAG: int) -> None:  # fmt: skip
    """Torch port of ``sglang.srt.utils.phase_checker._phase_check_kernel``."""
    if int(enable_assert.reshape(-1)[0]) and int(phase) != EXPECT_PHASE:
        raise AssertionError(f"SimplePhaseChecker: phase mismatch (caller_tag={CALLER_TAG})")
    phase.fill_(NEXT_PHASE)


class _Done:
    def synchronize(self) -> None:
        pass


def _cpu_device_to_host(cls: Any, xs: Any, *, d2h_stream: Any) -> Any:
    """``FutureTensors.device_to_host`` on a CPU: the same payload, copied at once."""
    from sglang.srt.kv_canary.runner.future_tensor import _DUMMY_DICT_KEY

    if not isinstance(xs, dict):
        xs = {_DUMMY_DICT_KEY: xs}
    data = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in xs.items()}
    return cls(_data=data, _event=_Done(), _retained_device_clones=None)


class SGLangOwnCanary:
    """SGLang's own KV canary (``attach_canary_buffers`` + its ``CanaryManager`` runner) on a
    pool, driven with the same two calls as ours (``before_forward`` / ``after_forward`` of
    an :class:`SGLangForwardBatchView`), as SGLang's model runner brackets a forward: the
    outside-graph ops around the inside-graph ops of single-forward manager 0."""

    def __init__(self, pool: Any, r2t: Any, allocator: Any, *, real_data: str, window: int | None):
        from contextlib import ExitStack

        from sglang.kernels.ops.kv_canary.consts import RealKvHashMode
        from sglang.srt.kv_canary.capacities import CanaryLaunchCapacities
        from sglang.srt.kv_canary.config import CanaryConfig as SGLangConfig
        from sglang.srt.kv_canary.config import CanaryMode
        from sglang.srt.kv_canary.perturb.config import PerturbConfig
        from sglang.srt.kv_canary.pool_patcher.api import attach_canary_buffers
        from sglang.srt.kv_canary.runner.canary_manager import CanaryManager
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.runtime_context import get_context

        get_context().override_server_args(device="cpu").install()  # capacities read it
        # SGLang 0.5.23's create_device_stream passes device= to the stream class, which
        # torch.cpu.Stream does not take (the one thing that stops its runner on a CPU)
        canary_manager_module = sys.modules[CanaryManager.__module__]
        canary_manager_module.create_device_stream = lambda device: torch.cpu.Stream()
        # ... and its runner's phase checker is a Triton kernel: a torch port of its body
        from sglang.srt.utils import phase_checker

        phase_checker._phase_check_kernel = _Launch(_phase_check)
        # ... and its delayed device->host reads stage into pinned memory on a device stream
        from sglang.srt.kv_canary.runner import future_tensor

        future_tensor.FutureTensors.device_to_host = classmethod(_cpu_device_to_host)
        config = SGLangConfig(
            mode=CanaryMode.LOG, ring_capacity=1024, sweep_interval=0,
            real_kv_hash_mode=RealKvHashMode[real_data.upper()], enable_write_input_assert=False,
            enable_verify_token_assert=False, stats_print_every_n_steps=0,
        )  # fmt: skip
        device = torch.device(DEVICE)
        self.groups = attach_canary_buffers(pool=pool, config=config, device=device,
                                            kv_token_id_vs_position_offset=0)  # fmt: skip
        self.manager = CanaryManager(
            config=config,
            perturb_config=PerturbConfig(req_to_token_prob=0.0, real_kv_used_prob=0.0,
                                         real_kv_unused_cache_prob=0.0,
                                         real_kv_post_forward_prob=0.0, target_group_kind=None,
                                         warmup_steps=0),
            buffer_groups=self.groups, device=device, req_to_token_pool=r2t,
            launch_capacities=CanaryLaunchCapacities.from_args(
                req_to_token_pool_size=r2t.size, max_seq_len_per_req=r2t.req_to_token.shape[1],
                pool_slot_count=int(pool.size)),
            swa_window_size=window or 0,
            swa_allocator=allocator if isinstance(allocator, SWATokenToKVPoolAllocator) else None,
        )  # fmt: skip
        self.manager.mark_init_finished()
        self._stack = ExitStack()
        self._pre: Any = None

    def before_forward(self, view: Any) -> None:
        fb = view.forward_batch
        self._stack.enter_context(self.manager.with_ops_outside_graph(
            single_forward_indices=[0], maybe_inaccurate_forward_batch=fb))  # fmt: skip
        self._stack.enter_context(self.manager.with_active_single_forward_manager(0))
        self._pre = self.manager.pre_ops_maybe_inside_graph(fb)

    def after_forward(self, view: Any) -> None:
        self.manager.post_ops_maybe_inside_graph(view.forward_batch, self._pre)
        self._stack.close()

    def violation_count(self) -> int:
        state = self.manager._device_state
        log = getattr(state, "violation_log", state)
        for name in ("violation_write_index", "write_index", "num_violations"):
            if hasattr(log, name):
                return int(getattr(log, name).reshape(-1)[0])
        raise AttributeError("SGLang's device state has no violation counter")
