"""ModelRunner: owns the model, the KV memory (pools, allocator, req→token table) and
the attention backend; runs one forward per call.

Who owns what:
  * ``token_to_kv_pool`` — the K/V tensors (MHAKVPool, SWAKVPool for models with
    sliding layers, DSV4KVPool for DeepSeek-V4); written only by the attention backend
    during a forward.
  * ``allocator`` — which slots are live (PagedAllocator/TokenAllocator or SWAAllocator,
    the latter also owns the full→SWA mapping); mutated only by the scheduler.
  * ``req_to_token_pool`` — per-request slot rows; written only by the scheduler.
  * ``canary`` — the forward hooks of a guest (the KV canary, installed by
    ``kvcanary.integrations.native.host``); None: no guest, no cost.

The runner is also the KV canary's host object (``kvcanary.canary.host.CanaryHost``:
``token_to_kv_pool``, ``req_to_token_pool``, ``device``, ``sliding_window``,
``is_draft_worker``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvcanary.config import EngineConfig
from kvcanary.engine.attention import PagedAttentionBackend
from kvcanary.engine.dsv4_attention import DSV4AttentionBackend
from kvcanary.engine.forward_batch import ForwardBatch
from kvcanary.engine.hooks import ForwardHooks
from kvcanary.memory.allocator import PagedAllocator, make_allocator
from kvcanary.memory.base import HOST, resolve_device
from kvcanary.memory.dsv4_pool import DSV4KVPool
from kvcanary.memory.mha_pool import MHAKVPool
from kvcanary.memory.req_to_token import ReqToTokenPool
from kvcanary.memory.swa_allocator import SWAAllocator
from kvcanary.memory.swa_pool import SWAKVPool
from kvcanary.model import ModelConfig, load_model
from kvcanary.model.decoder import HybridDecoder
from kvcanary.ops.cpu.decode import CompiledDecode
from kvcanary.utils import floor_page, show

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


KVPoolType = MHAKVPool | SWAKVPool | DSV4KVPool


def build_kv_memory(
    config: EngineConfig, model_config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> tuple[KVPoolType, PagedAllocator | SWAAllocator]:
    """Pool + allocator for the model: an SWA pair when the model has sliding layers (a
    DSV4 pool, whose full side is the logical index space of its compressed sub-pools,
    for DeepSeek-V4).

    The full pool holds ``max_total_tokens``; the SWA pool
    ``floor_page(max_total_tokens * swa_full_tokens_ratio)`` (at least two pages).
    """
    ps = config.page_size
    full_tokens = floor_page(config.max_total_tokens, ps)
    kv_heads, head_dim = model_config.num_key_value_heads, model_config.head_dim
    if not model_config.has_sliding:
        pool = MHAKVPool(
            full_tokens, ps, dtype, kv_heads, head_dim, model_config.num_hidden_layers, device
        )
        return pool, make_allocator(full_tokens, ps, device)
    swa_tokens = max(floor_page(int(full_tokens * config.swa_full_tokens_ratio), ps), 2 * ps)
    if model_config.dsv4 is not None:
        need = model_config.min_page_size
        if ps % need:
            raise ValueError(
                f"--page-size {ps} is invalid for {show(config.model)}: its compressed layers "
                f"need a multiple of {need}"
            )
        dsv4 = DSV4KVPool(
            full_tokens, swa_tokens, ps, model_config.compression_ratios, head_dim,
            model_config.dsv4.index_head_dim, dtype, device,
        )  # fmt: skip
        return dsv4, SWAAllocator(full_tokens, swa_tokens, ps, device, kvcache=dsv4)
    swa_pool = SWAKVPool(
        full_tokens,
        swa_tokens,
        ps,
        dtype,
        kv_heads,
        head_dim,
        swa_attention_layer_ids=model_config.swa_layer_ids,
        full_attention_layer_ids=model_config.full_layer_ids,
        device=device,
    )
    allocator = SWAAllocator(full_tokens, swa_tokens, ps, device, kvcache=swa_pool)
    return swa_pool, allocator


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = _DTYPES[config.dtype]
        self.model, self.tokenizer, self.model_config = load_model(
            config.model, device=self.device, dtype=self.dtype, seed=config.seed
        )
        self.model.eval()
        mc = self.model_config
        self.max_context_len = config.max_context_len or mc.max_position_embeddings
        windows = {mc.window_of(i) for i in mc.swa_layer_ids}
        if len(windows) > 1:
            raise ValueError(f"model {show(config.model)}: sliding layers with different windows {windows} are not supported")
        self.sliding_window: int | None = windows.pop() if windows else None
        self.req_to_token_pool = ReqToTokenPool(
            config.max_running_requests, self.max_context_len, self.device
        )
        self.token_to_kv_pool, self.allocator = build_kv_memory(config, mc, self.device, self.dtype)
        pool = self.token_to_kv_pool
        self.attn_backend: PagedAttentionBackend | DSV4AttentionBackend
        if isinstance(pool, DSV4KVPool):
            if self.sliding_window is None:
                raise ValueError(f"model {show(config.model)}: a DeepSeek-V4 model without a window")
            self.attn_backend = DSV4AttentionBackend(pool, self.req_to_token_pool, self.sliding_window)
        else:
            self.attn_backend = PagedAttentionBackend(pool, self.req_to_token_pool, self.sliding_window)
        self.forward_ct = 0
        # The CPU decode forward in one compiled call (ops/cpu/decode.py), where it applies.
        self._compiled_decode = (CompiledDecode(self.model)
                                 if self.device == HOST and isinstance(self.model, HybridDecoder)
                                 else None)  # fmt: skip
        self.is_draft_worker = False  # a speculative draft worker would hold token p + 1 at p
        # Set by kvcanary.integrations.native.host; None: no canary, no cost.
        self.canary: ForwardHooks | None = None

    @property
    def is_swa(self) -> bool:
        return isinstance(self.allocator, SWAAllocator)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def begin_forward(self, fb: ForwardBatch) -> None:
        """Host work before any forward (or graph replay) of ``fb``."""
        self.forward_ct += 1
        # A new forward epoch: no SWA translation may be reused across forwards.
        self.token_to_kv_pool.begin_forward()
        fb.req_to_token_pool = self.req_to_token_pool
        fb.token_to_kv_pool = self.token_to_kv_pool
        fb.attn_backend = self.attn_backend

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, static: Callable[[], None] | None = None) -> torch.Tensor:
        """Run the model over ``fb``; returns float32 logits ``[bs, vocab]`` of each
        request's last new token (``fb.all_logits``: ``[num_tokens, vocab]``, every token). ``static`` (graph runner): called after the attention
        metadata is built, to move it into persistent buffers."""
        self.begin_forward(fb)
        hooks = self.canary
        if hooks is not None:
            # Before attention gathers its slot tables: the canary's host pre-ops (fault
            # injection included) must be what attention reads, as in a real forward.
            hooks.before_forward(fb)
        self.attn_backend.init_forward_metadata(fb)
        if static is not None:
            static()
        hidden = None
        if fb.is_decode and self._compiled_decode is not None:
            hidden = self._compiled_decode.forward(fb.input_ids, fb.positions, fb)
        if hidden is None:
            hidden = self.model(fb.input_ids, fb.positions, fb)
        if hooks is not None:
            hooks.after_forward(fb)
        # A decode forward's rows are its requests' last tokens already (no gathered copy).
        if fb.is_decode or fb.all_logits:
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[fb.last_token_indices()])
