"""Tenant isolation: each request's records carry its cache namespace, so KV shared across
namespaces is a violation.

vLLM keeps requests of different LoRA adapters, or with different ``cache_salt``, apart in
its prefix cache by folding them into the block hashes (``vllm/v1/core/kv_cache_utils.py``:
``generate_block_hash_extra_keys``). A bug there (vLLM #27211's lineage: a LoRA identity by
name only, or none; #44701: a LoRA name equal to a salt) gives one tenant a prefix hit on
KV another tenant's adapter computed. The records of such KV agree with each other (same
tokens, same positions, the bytes are what was stored), so no check sees it, unless the
records know the namespace.

With ``tenant_isolation`` on, the scheduler side sends each token id XOR-ed with its
request's salt (64 bits of BLAKE2b over the namespace; 0 for the default namespace: no
adapter, no salt, so such requests keep SGLang-compatible records). Writes store salted
tokens, verifies expect the reader's salted tokens: a slot written under another namespace
fails the token check (``verify_token``) at every position of a cross-namespace hit, and
the chain of every slot after it. In log lines and summaries the token fields of a salted
request are salted (``token ^ salt``; ``kvcanary explain`` names the cause). Multimodal
inputs are not part of the namespace: vLLM keys them per block from their position on, and
a text prefix before an image is legitimately shared.
"""

from __future__ import annotations

import hashlib
from typing import Any

#: Salted token fields are at least this large: no vocabulary reaches it.
SALTED_TOKEN_MIN = 1 << 62


def namespace(request: Any) -> tuple[tuple[str, str], ...]:
    """The cache namespace of a vLLM request: its LoRA adapter (name and path, as vLLM
    0.32 keys it) and its ``cache_salt``, each tagged (a salt equal to an adapter's name is
    another namespace)."""
    parts: list[tuple[str, str]] = []
    lora = getattr(request, "lora_request", None)
    if lora:
        parts.append(("lora", f"{lora.lora_name}\0{getattr(lora, 'lora_path', '')}"))
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(("cache_salt", str(salt)))
    return tuple(parts)


def salt_of(ns: tuple[tuple[str, str], ...]) -> int:
    """The int64 salt of a namespace: 0 for the default one; otherwise 64 bits of BLAKE2b
    with the top bit clear and bit 62 set (so every salted token id is >= 2^62 > any
    vocabulary, and never -1, the "unknown token" sentinel)."""
    if not ns:
        return 0
    digest = hashlib.blake2b(repr(ns).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & ((1 << 62) - 1)) | (1 << 62)


def salted(tokens: list[int], salt: int) -> list[int]:
    """``tokens`` XOR ``salt`` (unknown tokens, -1, stay -1)."""
    if not salt:
        return tokens
    return [t if t < 0 else t ^ salt for t in tokens]
