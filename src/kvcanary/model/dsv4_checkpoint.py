"""DeepSeek-V4 checkpoint tensor names -> our (Hugging Face module) names.

DeepSeek-V4 checkpoints, including the ones transformers' ``save_pretrained`` writes,
store tensors under DeepSeek's own names (``layers.3.attn.wq_a.weight``,
``layers.3.ffn.experts.7.w1.weight``, ``head.weight``), optionally with a ``model.``
prefix; transformers renames them on load (its ``conversion_mapping``) and merges the
per-expert ``w1``/``w3`` into ``gate_up_proj`` and ``w2`` into ``down_proj``. This does the
same, one tensor at a time: :func:`checkpoint_target` names the parameter (and, for an
expert, the slice) a checkpoint tensor fills. Names already in our form pass unchanged.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch

# In order (later patterns see earlier results), as transformers' deepseek_v4 mapping.
_RENAMES = [(re.compile(p), r) for p, r in (
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"),
    (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"),
    (r"^hc_head_base", "hc_head.hc_base"),
    (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"),
    (r"\.hc_attn_base", ".attn_hc.base"),
    (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"),
    (r"\.hc_ffn_base", ".ffn_hc.base"),
    (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)]  # fmt: skip
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(w[123])\.weight$")
_PART = {"w1": "gate", "w3": "up", "w2": "down"}


class ExpertPart(NamedTuple):
    """Expert ``expert``'s ``part`` (gate / up: halves of ``gate_up_proj``; down)."""

    expert: int
    part: str

    def view(self, param: torch.Tensor) -> torch.Tensor:
        rows = param[self.expert]
        if self.part == "down":
            return rows
        half = rows.shape[0] // 2
        return rows[:half] if self.part == "gate" else rows[half:]


def checkpoint_target(key: str) -> tuple[str, ExpertPart | None]:
    """The Hugging Face parameter name (``model.``-prefixed but for ``lm_head``) a
    checkpoint tensor fills, and the expert slice when it is one expert's weight."""
    name = key.removeprefix("model.")
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    part = None
    expert = _EXPERT.match(name)
    if expert is not None:
        part = ExpertPart(int(expert.group(2)), _PART[expert.group(3)])
        name = expert.group(1) + (".down_proj" if part.part == "down" else ".gate_up_proj")
    return (name if name.startswith("lm_head.") else "model." + name), part


def expected_labels(name: str, param: torch.Tensor) -> list[str]:
    """What must be loaded into ``param``: itself, or each expert's parts."""
    if name.endswith(".experts.gate_up_proj"):
        return [f"{name}[{e}.{p}]" for e in range(param.shape[0]) for p in ("gate", "up")]
    if name.endswith(".experts.down_proj"):
        return [f"{name}[{e}.down]" for e in range(param.shape[0])]
    return [name]


def label(name: str, part: ExpertPart | None) -> str:
    return name if part is None else f"{name}[{part.expert}.{part.part}]"
