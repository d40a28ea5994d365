"""Request → token table: which full-pool slot holds each position of each request.

Layout (int32 ``[size + 1, max_context_len]``)::

    row 0      padding row: graph-padded batches point here; never handed out
    row 1..N   one row per live request; row[r, p] = full-pool slot of position p

Only the owner of a row writes it (the scheduler). Entries past a request's
sequence length are stale and must never be read.

Beside it, ``token_ids[r, p]`` mirrors the token id at position ``p`` of row ``r``'s
request (prompt + outputs) for the first ``token_lens[r]`` positions, so a checker can
compare what a KV slot claims to hold with what the request really contains.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcanary.memory.base import HOST
from kvcanary.memory.errors import DoubleFreeError, PoolExhaustedError, raise_if_problems

REQ_POOL_IDX_PADDING = 0


class ReqToTokenPool:
    def __init__(self, size: int, max_context_len: int, device: torch.device | str = "cpu"):
        if size < 1:
            raise ValueError(f"ReqToTokenPool size={size}: must be >= 1")
        if max_context_len < 1:
            raise ValueError(f"ReqToTokenPool max_context_len={max_context_len}: must be >= 1")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros(
            (size + 1, max_context_len), dtype=torch.int32, device=self.device
        )
        self.token_ids = torch.zeros((size + 1, max_context_len), dtype=torch.int64, device=self.device)
        self.token_lens = torch.zeros(size + 1, dtype=torch.int64, device=self.device)
        self._free_rows: list[int] = list(range(1, size + 1))
        self._is_free = [False] + [True] * size
        # On the host (base.HOST): numpy views of the token mirror (torch's advanced indexing
        # costs ~5 us an op; a decode step writes a few entries).
        self._host = (
            (self.token_ids.numpy(), self.token_lens.numpy()) if self.device == HOST else None
        )
        # And of the slot table, for the engine's host paths (the KV manager's decode reads
        # and writes, attention's decode tables); None off the host.
        self.host_table = self.req_to_token.numpy() if self.device == HOST else None

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self, num_reqs: int = 1) -> list[int]:
        """Hand out ``num_reqs`` rows; raises :class:`PoolExhaustedError` (nothing taken) if short."""
        if num_reqs > len(self._free_rows):
            raise PoolExhaustedError(
                f"req_to_token pool exhausted: asked for {num_reqs} rows, "
                f"{len(self._free_rows)} of {self.size} free (raise max_running_requests)"
            )
        rows, self._free_rows = self._free_rows[:num_reqs], self._free_rows[num_reqs:]
        for r in rows:
            self._is_free[r] = False
        return rows

    def free(self, row: int) -> None:
        if not 1 <= row <= self.size:
            raise ValueError(f"req_to_token row={row}: must be in [1, {self.size}]")
        if self._is_free[row]:
            raise DoubleFreeError(f"req_to_token row {row} freed twice")
        self._is_free[row] = True
        self._free_rows.append(row)
        self.token_lens[row] = 0

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """``req_to_token[row, start:start+len(slots)] = slots``."""
        end = start + slots.numel()
        if end > self.max_context_len:
            raise ValueError(
                f"sequence length {end} exceeds max_context_len={self.max_context_len}"
            )
        self.req_to_token[row, start:end] = slots.to(torch.int32)

    def set_tokens(self, row: int, token_ids: list[int]) -> None:
        """Mirror a request's whole token sequence into ``row``."""
        n = len(token_ids)
        if n > self.max_context_len:
            raise ValueError(f"sequence length {n} exceeds max_context_len={self.max_context_len}")
        self.token_ids[row, :n] = torch.as_tensor(token_ids, dtype=torch.int64)
        self.token_lens[row] = n

    def append_tokens(self, rows: list[int], positions: list[int], token_ids: list[int]) -> None:
        """One new token per row at ``positions`` (= the old length)."""
        if self._host is not None:  # the few entries of a decode step, written where they are
            token_ids_np, token_lens_np = self._host
            rows_np = np.asarray(rows, dtype=np.int64)  # (each converted once)
            positions_np = np.asarray(positions, dtype=np.int64)
            token_ids_np[rows_np, positions_np] = token_ids
            token_lens_np[rows_np] = positions_np + 1
            return
        r = torch.as_tensor(rows, dtype=torch.int64, device=self.device)
        p = torch.as_tensor(positions, dtype=torch.int64, device=self.device)
        self.token_ids[r, p] = torch.as_tensor(token_ids, dtype=torch.int64, device=self.device)
        self.token_lens[r] = p + 1

    def clear(self) -> None:
        self.token_lens.zero_()
        self._free_rows = list(range(1, self.size + 1))
        self._is_free = [False] + [True] * self.size

    def check_integrity(self) -> bool:
        problems = []
        if len(set(self._free_rows)) != len(self._free_rows):
            problems.append("duplicate rows in the free list")
        if REQ_POOL_IDX_PADDING in self._free_rows:
            problems.append("padding row 0 is in the free list")
        if sorted(self._free_rows) != [r for r in range(1, self.size + 1) if self._is_free[r]]:
            problems.append("free list and free flags disagree")
        return raise_if_problems("ReqToTokenPool", problems)
