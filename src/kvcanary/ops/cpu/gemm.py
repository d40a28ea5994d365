"""Linear layers on the CPU through oneDNN with the weight pre-packed once.

``F.linear`` on a CPU tensor re-lays the weight out for the GEMM microkernel on every call;
for a decode batch (a few to a few hundred rows against a weight of megabytes) that re-layout
is a large share of the call. oneDNN can keep the weight in its blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``, the same packing inductor's CPU freezing and
vLLM's CPU build use) and run the GEMM on it directly. Measured on this repo's 2-core AMD EPYC
(AVX-512, avx512_bf16, no AMX), float32, 2 threads, packed / ``F.linear`` time (weights read
from DRAM: 12 of them in rotation, as a model's decode reads them): ``N x K = 4096 x 1024`` at
1 / 4 / 16 / 64 / 256 / 512 / 1024 rows 0.79 / 0.27 / 0.44 / 0.59 / 0.60 / 0.60 / 0.63,
``1024 x 3072`` 0.81 / 0.46 / 0.49 / 0.67 / 0.76 / 0.73 / 0.69; weights under 1 MiB (the tiny
presets' 64-256 KiB, warm) lose below ~128 rows (2.2-3.8x slower at 1 row, the packed call's
fixed cost) and win from 512 (0.63-0.95 at 512-4096 rows: a prefill chunk). So
:class:`PackedLinear` packs weights of at least :data:`MIN_PACKED_BYTES` for the row counts of
:data:`PACKED_ROWS` and smaller ones for those of :data:`SMALL_PACKED_ROWS`; everything else,
and every non-CPU tensor, goes to ``F.linear``. (An earlier 2-core Intel AVX-512 / AMX machine
measured ``F.linear`` / packed at ``K = 1024``, ``N = 4096``: 348 / 390 us at 1 row, 953 / 543
at 8, 1504 / 1031 at 32, 12653 / 12731 at 512; bfloat16 (AMX) won from 1 row to ~1024.) MKL's
packed GEMM (``torch.ops.mkl._mkl_linear``, inductor's float32 choice) measured the same as
oneDNN's on a 2-core Intel Xeon (Emerald Rapids): ``3072 x 1024``, 16 rows, weights in
rotation, 0.81-0.93 vs 0.83-0.95 ms (``F.linear`` 1.18-1.25).

The packed copy doubles the weight memory of the layers that use it (vLLM drops the
original; we keep it: row counts outside the packed range, checkpoint export and parity
tests read it). A weight is packed only while the machine keeps :data:`MIN_FREE_FRACTION`
of its memory (and at least :data:`MIN_FREE_BYTES`) available after the copy
(``/proc/meminfo``'s MemAvailable): a model that fits without copies still fits. Results
differ from ``F.linear`` by float rounding only (~1e-4 relative in float32: the same products,
summed in another order). ``KVCANARY_CPU_GEMM``: ``auto`` (the policy above), ``onednn``
(pack every CPU weight for every row count: tests use it on tiny models) or ``torch`` (always
``F.linear``). Where oneDNN cannot pack a dtype on this CPU (bfloat16 without AVX-512 BW/VL/DQ
or AVX-NE-CONVERT: :func:`packable`), its weights go to ``F.linear``.
"""

from __future__ import annotations

from functools import cache

import torch
from torch.nn import functional as F

from kvcanary import envs

# vLLM's CPU build uses the same 1 MiB bound between small and packed GEMMs.
MIN_PACKED_BYTES = 1 << 20
# Row counts where the packed GEMM measured faster than F.linear (see the module doc): for
# weights of at least MIN_PACKED_BYTES, and for smaller ones (a prefill chunk's rows).
_ANY_ROWS = 1 << 62  # no upper bound on the row count
PACKED_ROWS = {torch.float32: (1, _ANY_ROWS), torch.bfloat16: (1, 1024)}
SMALL_PACKED_ROWS = {torch.float32: (512, _ANY_ROWS)}
# Memory a packed copy must leave available (module doc).
MIN_FREE_FRACTION = 0.1
MIN_FREE_BYTES = 2 << 30


def memory_info() -> tuple[int, int] | None:
    """(MemAvailable, MemTotal) in bytes from ``/proc/meminfo``; None where unreadable."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        available_kib, total_kib = fields["MemAvailable"].split()[0], fields["MemTotal"].split()[0]
        return int(available_kib) * 1024, int(total_kib) * 1024
    except (OSError, KeyError, ValueError):
        return None


def can_afford(nbytes: int) -> bool:
    """Whether a ``nbytes`` copy leaves enough memory available (module doc)."""
    info = memory_info()
    if info is None:
        return True
    available, total = info
    return available - nbytes >= max(MIN_FREE_BYTES, int(MIN_FREE_FRACTION * total))


@cache
def packable(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs ``dtype`` weights on this CPU (bfloat16 needs avx512bw/vl/dq or
    avx_ne_convert; elsewhere ``_reorder_linear_weight`` refuses it and such weights go to
    ``F.linear``)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype))
    except RuntimeError:
        return False
    return True


@cache
def cpu_gemm_mode() -> str:
    """``KVCANARY_CPU_GEMM``, read once per process (``cache_clear()`` re-reads it)."""
    if not torch.backends.mkldnn.is_available():
        return "torch"
    return envs.KVCANARY_CPU_GEMM.get()


class PackedLinear:
    """``F.linear(x, weight, bias)`` for one weight, through a oneDNN-packed copy where that
    is faster (module doc). The packed copy is rebuilt when the weight tensor is replaced or
    written in place (its version counter; a fused weight's views share it)."""

    __slots__ = ("_weight", "_rows", "_packed", "_key")

    def __init__(self) -> None:
        self._weight: torch.Tensor | None = None  # the weight the decision below is for
        self._rows: tuple[int, int] | None = None  # packed row range; None: never pack
        self._packed: torch.Tensor | None = None
        self._key: tuple[int, int] | None = None  # (data_ptr, _version) of the packed weight

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if weight is not self._weight:
            self._decide(weight)
        rows = self._rows
        if rows is None or x.device.type != "cpu" or torch.compiler.is_compiling():
            return F.linear(x, weight, bias)
        m = x.numel() // x.shape[-1] if x.dim() else 0
        if not rows[0] <= m <= rows[1] or x.dtype != weight.dtype or x.requires_grad:
            return F.linear(x, weight, bias)
        key = (weight.data_ptr(), weight._version)
        if key != self._key:
            self._packed = None  # the stale copy goes first
            if not can_afford(weight.numel() * weight.element_size()):
                self._rows = None  # not packed: F.linear from now on
                return F.linear(x, weight, bias)
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
            self._key = key
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")

    def _decide(self, weight: torch.Tensor) -> None:
        self._weight, self._rows, self._packed, self._key = weight, None, None, None
        mode = cpu_gemm_mode()
        if mode == "torch" or weight.device.type != "cpu" or weight.dim() != 2:
            return
        if weight.dtype not in PACKED_ROWS or weight.requires_grad or weight.is_inference():
            return  # (inference tensors keep no version counter to notice in-place writes)
        if not packable(weight.dtype):
            return
        if mode == "onednn":
            self._rows = (1, _ANY_ROWS)
        elif weight.numel() * weight.element_size() >= MIN_PACKED_BYTES:
            self._rows = PACKED_ROWS[weight.dtype]
        else:
            self._rows = SMALL_PACKED_ROWS.get(weight.dtype)
