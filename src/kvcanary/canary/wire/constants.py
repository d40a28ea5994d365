"""Wire-level constants of the canary, shared with SGLang's canary byte for byte.

Slot record (one per KV-pool slot, 32 bytes, four little-endian int64 fields)::

    byte  0        8          16           24            32
          | token  | position | prev_hash  | real_kv_hash |

``prev_hash`` is the chain hash *before* this slot (see :mod:`kvcanary.canary.wire.hashing`);
``real_kv_hash`` is the fingerprint of the slot's real KV bytes (0 when disabled).

Two fail reasons are kvcanary's own (bits 6 and 7; SGLang defines bits 0..5):

* ``verify_not_resident``: a verify entry inside the range attention reads (FULL groups:
  ``[0, prefix_len)``; SWA groups: ``[prefix_len - window + 1, prefix_len)``, from
  ``prefix_len - window`` where the host's attention reads it: SGLang's) has no slot:
  its req->token entry is 0, or (SWA) the full->SWA mapping of its full slot is 0 (the
  window was evicted early). The row names the *full* slot (``slot_idx``), the position,
  ``stored_token = expected_token = -1``, ``stored_chain_hash = 0`` and ``expected_aux =
  prefix_len`` (the sequence length whose window needed the position).
* ``write_kv_store``: after the forward, a slot written this forward does not hold the K/V
  bytes attention was given for its token (a lost or misdirected store). ``stored_chain_hash``
  is the fingerprint of the pool's bytes, ``expected_aux`` that of the bytes attention stored.

Launch tags are ``kind * 6 + stage * 2 + half``; SGLang defines kinds FULL and SWA (tags
0..11). kvcanary adds the DeepSeek-V4-style compressed sub-pools as kinds 2..4 (tags 12..29)
and their compress-state rings as kinds 5..7 (tags 30..47), which never appear in SGLang
logs and leave tags 0..11 untouched.
"""

from __future__ import annotations

from enum import IntEnum, IntFlag

CANARY_FIELDS_PER_SLOT = 4
CANARY_SLOT_BYTES = CANARY_FIELDS_PER_SLOT * 8  # 32
CANARY_FIELD_TOKEN = 0
CANARY_FIELD_POSITION = 1
CANARY_FIELD_PREV_HASH = 2
CANARY_FIELD_REAL_KV_HASH = 3

# Slot 0 of every token pool and row 0 of req_to_token are padding: never a real slot/request.
TOKEN_TO_KV_SLOT_PADDING = 0
REQ_POOL_IDX_PADDING = 0
# Plan sentinels: a predecessor/seed slot of -1 means "chain starts here" (the anchor), a write
# slot of -1 means "skip this token", an expected token of -1 means "not checked".
NO_SLOT = -1
NO_TOKEN = -1

CANARY_CHAIN_ANCHOR = 0xC0FFEE1234567890  # bug detection, not adversarial security: no seed
SPLITMIX64_MUL1 = 0xBF58476D1CE4E5B9
SPLITMIX64_MUL2 = 0x94D049BB133111EB

# Real-KV fingerprint sources (field 3).
MAX_REAL_KV_SOURCES = 4
REAL_KV_BYTE_ALIGNMENT = 16  # CUDA loads 128 bits at a time; all byte counts are multiples
REAL_KV_PARTIAL_READ_BYTES = 16

# Violation ring: int64 rows of 8 columns.
VIOLATION_ROW_FIELDS = 8
RING_COL_LAUNCH_TAG = 0
RING_COL_SLOT_IDX = 1
RING_COL_POSITION = 2
RING_COL_STORED_TOKEN = 3
RING_COL_EXPECTED_TOKEN = 4
RING_COL_STORED_CHAIN_HASH = 5
RING_COL_EXPECTED_AUX = 6  # verify: expected chain hash; write: expected position
RING_COL_FAIL_REASON = 7
DEFAULT_RING_CAPACITY = 1024


class PoolKind(IntEnum):
    """Attention regime a canary buffer group covers (FULL/SWA numbering is SGLang's)."""

    FULL = 0  # positions [0, prefix_len)
    SWA = 1  # positions [max(0, prefix_len - window), prefix_len), SWA sub-pool slots
    C4 = 2  # kvcanary: DSV4 compressed ratio-4 sub-pool
    C128 = 3  # kvcanary: DSV4 compressed ratio-128 sub-pool
    INDEXER = 4  # kvcanary: DSV4 C4 lightning-indexer sub-pool
    # kvcanary: DSV4 compress-state rings (one record per ring row: the token whose raw
    # compressor state the row holds; only the live tail is verified, see .state_plan)
    C4_STATE = 5  # the C4 compressor's ring
    C128_STATE = 6  # the C128 compressor's ring
    INDEXER_STATE = 7  # the C4 lightning indexer's compressor ring


class LaunchStage(IntEnum):
    HEAD = 0  # before the forward: verify committed prefix, write new tokens (no real KV)
    TAIL = 1  # after the forward: same, with real-KV fingerprints
    SWEEP = 2  # periodic radix-tree sweep: verify only, shares the tail buffer


class KvHalf(IntEnum):
    K = 0
    V = 1


NUM_LAUNCH_STAGES = len(LaunchStage)
NUM_KV_HALVES = len(KvHalf)


class CanaryLaunchTag(IntEnum):
    """Stamped into every violation row; numbers and names are wire format."""

    HEAD_K_FULL = 0
    HEAD_V_FULL = 1
    TAIL_K_FULL = 2
    TAIL_V_FULL = 3
    SWEEP_K_FULL = 4
    SWEEP_V_FULL = 5
    HEAD_K_SWA = 6
    HEAD_V_SWA = 7
    TAIL_K_SWA = 8
    TAIL_V_SWA = 9
    SWEEP_K_SWA = 10
    SWEEP_V_SWA = 11
    HEAD_K_C4 = 12
    HEAD_V_C4 = 13
    TAIL_K_C4 = 14
    TAIL_V_C4 = 15
    SWEEP_K_C4 = 16
    SWEEP_V_C4 = 17
    HEAD_K_C128 = 18
    HEAD_V_C128 = 19
    TAIL_K_C128 = 20
    TAIL_V_C128 = 21
    SWEEP_K_C128 = 22
    SWEEP_V_C128 = 23
    HEAD_K_INDEXER = 24
    HEAD_V_INDEXER = 25
    TAIL_K_INDEXER = 26
    TAIL_V_INDEXER = 27
    SWEEP_K_INDEXER = 28
    SWEEP_V_INDEXER = 29
    HEAD_K_C4_STATE = 30
    HEAD_V_C4_STATE = 31
    TAIL_K_C4_STATE = 32
    TAIL_V_C4_STATE = 33
    SWEEP_K_C4_STATE = 34
    SWEEP_V_C4_STATE = 35
    HEAD_K_C128_STATE = 36
    HEAD_V_C128_STATE = 37
    TAIL_K_C128_STATE = 38
    TAIL_V_C128_STATE = 39
    SWEEP_K_C128_STATE = 40
    SWEEP_V_C128_STATE = 41
    HEAD_K_INDEXER_STATE = 42
    HEAD_V_INDEXER_STATE = 43
    TAIL_K_INDEXER_STATE = 44
    TAIL_V_INDEXER_STATE = 45
    SWEEP_K_INDEXER_STATE = 46
    SWEEP_V_INDEXER_STATE = 47


NUM_LAUNCH_TAGS = len(CanaryLaunchTag)
NUM_SGLANG_LAUNCH_TAGS = 12  # tags 0..11; the stats line's `launch_tags_active=a/12` denominator


def launch_tag(kind: PoolKind, stage: LaunchStage, half: KvHalf) -> CanaryLaunchTag:
    """The tag of one (kind, stage, half) launch: ``kind * 6 + stage * 2 + half``."""
    return CanaryLaunchTag((kind * NUM_LAUNCH_STAGES + stage) * NUM_KV_HALVES + half)


def split_launch_tag(tag: int) -> tuple[PoolKind, LaunchStage, KvHalf]:
    """Inverse of :func:`launch_tag`; raises ``ValueError`` for an unknown tag number."""
    kind, rest = divmod(int(CanaryLaunchTag(tag)), NUM_LAUNCH_STAGES * NUM_KV_HALVES)
    stage, half = divmod(rest, NUM_KV_HALVES)
    return PoolKind(kind), LaunchStage(stage), KvHalf(half)


class FailReason(IntFlag):
    """Violation bits (int64), OR-ed per entry. Names are SGLang's newest."""

    VERIFY_CHAIN_HASH_MISMATCH = 1 << 0
    VERIFY_POSITION_MISMATCH = 1 << 1
    VERIFY_REAL_KV_HASH_MISMATCH = 1 << 2
    WRITE_TOKEN_MISMATCH = 1 << 3
    WRITE_POSITION_MISMATCH = 1 << 4
    VERIFY_TOKEN_MISMATCH = 1 << 5
    # kvcanary extensions (SGLang never sets them; its parsers print them as labels below).
    VERIFY_NOT_RESIDENT = 1 << 6  # a position attention reads has no slot (module doc)
    WRITE_KV_STORE_MISMATCH = 1 << 7  # the pool does not hold the K/V attention stored


WRITE_FAIL_REASONS = FailReason.WRITE_TOKEN_MISMATCH | FailReason.WRITE_POSITION_MISMATCH

# Log labels: enum name lower-cased without the `_mismatch` suffix (newest SGLang) ...
FAIL_REASON_LABELS: dict[FailReason, str] = {
    FailReason.VERIFY_CHAIN_HASH_MISMATCH: "verify_chain_hash",
    FailReason.VERIFY_POSITION_MISMATCH: "verify_position",
    FailReason.VERIFY_REAL_KV_HASH_MISMATCH: "verify_real_kv_hash",
    FailReason.WRITE_TOKEN_MISMATCH: "write_token",
    FailReason.WRITE_POSITION_MISMATCH: "write_position",
    FailReason.VERIFY_TOKEN_MISMATCH: "verify_token",
    FailReason.VERIFY_NOT_RESIDENT: "verify_not_resident",
    FailReason.WRITE_KV_STORE_MISMATCH: "write_kv_store",
}
# ... and the labels of older SGLang logs (`CHAIN_HASH`, `POSITION`, `REAL_KV_HASH`), parse-only.
LEGACY_FAIL_REASON_LABELS: dict[FailReason, str] = {
    FailReason.VERIFY_CHAIN_HASH_MISMATCH: "chain_hash",
    FailReason.VERIFY_POSITION_MISMATCH: "position",
    FailReason.VERIFY_REAL_KV_HASH_MISMATCH: "real_kv_hash",
    FailReason.WRITE_TOKEN_MISMATCH: "write_token",
    FailReason.WRITE_POSITION_MISMATCH: "write_position",
}


class RealKvHashMode(IntEnum):
    """`--kv-canary-real-data`: how many bytes of each slot's real KV feed field 3."""

    NONE = 0  # field 3 stays 0
    PARTIAL = 1  # first 16 bytes of the slot
    ALL = 2  # the whole slot (num_bytes_per_token)
