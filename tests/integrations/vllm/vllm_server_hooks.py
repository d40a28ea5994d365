"""A fault for a running vLLM server, through vLLM's own mechanisms: this class is the
server's ``--worker-extension-cls`` (vLLM adds it to its Worker's bases), and the test calls
its method over HTTP with ``POST /collective_rpc`` (served under
``VLLM_SERVER_DEV_MODE=1``). vLLM runs such a call in each worker between two engine steps.
"""

from __future__ import annotations

from typing import Any

import vllm_harness as H


class CanaryFaultHooks:
    """Methods vLLM's Worker gains (``self``: the worker)."""

    model_runner: Any

    def kvcanary_flip_k_byte(self, position: str) -> list[dict[str, Any]]:
        """Flip a byte of K (KV head 0, first layer of KV cache group 0) at the slot of
        ``position`` of every request in the running batch, in vLLM's KV cache tensor.
        Returns per request its id and the slot flipped (vLLM's ``block * bs + offset``)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        conn = get_kv_transfer_group()
        pos, bs = int(position), conn.specs[0].block_size
        batch = self.model_runner.input_batch
        table = batch.block_table.block_tables[0].block_table
        flipped = []
        for rid, row in batch.req_id_to_index.items():
            block = int(table.cpu[row, pos // bs])
            H.flip_k_byte(conn, 0, block, pos % bs)
            flipped.append({"request_id": rid, "slot": block * bs + pos % bs})
        return flipped
