"""Engine counters: the KV manager's memory counters and the scheduler's batching ones
(one object, shared by both; ``dataclasses.asdict`` of it is what reports print)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVStats:
    """Memory counters (the scheduler's stats embed them)."""

    num_retractions: int = 0
    num_swa_slots_evicted: int = 0  # SWA slots freed by window eviction
    num_swa_slots_tombstoned: int = 0  # SWA slots the prefix cache gave back (tombstones)
    # Slots abort mode's quarantine reclaimed that nothing referenced before it dropped a
    # request (KVManager.quarantine: a leak from elsewhere, logged as suspected)
    num_leaked_full_slots: int = 0
    num_leaked_swa_slots: int = 0
    peak_full_used: int = 0
    peak_swa_used: int = 0
    peak_full_active: int = 0  # minus the prefix cache's evictable part
    peak_swa_active: int = 0


@dataclass
class SchedulerStats(KVStats):
    """The KV manager's memory counters plus the batching ones."""

    num_forwards: int = 0
    num_extend_forwards: int = 0
    num_decode_forwards: int = 0
    num_prefill_tokens: int = 0  # tokens computed by extend forwards
    num_decode_tokens: int = 0
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    num_prompt_tokens: int = 0  # at first admission
    num_cached_prompt_tokens: int = 0  # of those, served by the prefix cache
    graph_replays: int = 0
    padded_rows: int = 0
    # Speculative decoding: request-steps that got drafts, draft tokens proposed and
    # accepted in them, verify steps that fell back to a plain decode (slots short), time
    # spent drafting (part of decode_time_s).
    spec_num_drafted_reqs: int = 0
    spec_num_proposed: int = 0
    spec_num_accepted: int = 0
    spec_fallbacks: int = 0
    spec_draft_time_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
