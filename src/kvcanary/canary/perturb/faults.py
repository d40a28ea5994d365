"""The faults themselves: each picks a target with the perturber's seeded RNG, corrupts it,
logs one line (SGLang's format for its modes) and returns an :class:`Injection`, or None
when the batch offers no target.

Metadata faults (``req_to_token``, ``swa_mapping``, ``page_shift``, ``stale_reuse``) are
transient: the injection carries an ``undo`` that the post-forward hook runs, so the
engine's own bookkeeping (allocator, prefix cache) stays sound and the run can go on; what
the forward did with the wrong metadata (KV read from or written to the wrong slot, records
chained from a wrong seed) stays. Byte flips and token swaps are permanent.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvcanary.canary.attach.buffers import CanaryBufferGroup
from kvcanary.canary.kernels.store_check import kv_buffer_owners
from kvcanary.canary.perturb.slots import WriteEntry, prefix_entries, write_entries

logger = logging.getLogger("kvcanary.canary")


@dataclass
class Injection:
    mode: str
    step: int  # index of the first forward that can see the fault
    group: str | None  # target group of byte flips (full | swa)
    detail: dict[str, int]
    undo: Callable[[], None] | None = field(default=None, repr=False)


def flip_byte(group: CanaryBufferGroup, slot: int, rng: random.Random, name: str) -> dict[str, int] | None:
    """XOR 0xFF into byte 0 of ``slot``'s read window (a strided source's: of its first
    element, at the token's start too) in a random K-half real-KV source of ``group``
    (``slot`` in the group's own index space)."""
    sources = group.real_kv_sources_k
    if not sources or slot <= 0:
        return None
    source_idx = rng.randrange(len(sources))
    src = sources[source_idx]
    row, col = slot // src.page_size, (slot % src.page_size) * src.num_bytes_per_token
    original = int(src.tensor[row, col])
    src.tensor[row, col] = original ^ 0xFF
    logger.warning(
        "kv_canary perturb %s: group=%s source_idx=%d slot=%d row=%d col=%d "
        "original_byte=0x%02X new_byte=0x%02X",
        name, group.kind.name.lower(), source_idx, slot, row, col, original, original ^ 0xFF,
    )  # fmt: skip
    return {"source_idx": source_idx, "slot": slot, "row": row, "col": col,
            "original_byte": original, "new_byte": original ^ 0xFF}  # fmt: skip


def group_slot(group: CanaryBufferGroup, full_slot: int) -> int:
    """``full_slot`` in the group's index space (0: not resident)."""
    lut = group.swa_index_lut
    return full_slot if lut is None else int(lut[full_slot])


def _unwritten_prefix(fb: Any, r2t: torch.Tensor) -> tuple[set[int], list[Any]]:
    """The slots ``fb`` writes, and the committed entries it reads that it does not write."""
    written = set(fb.out_cache_loc.tolist())
    return written, [e for e in prefix_entries(fb, r2t) if e.slot not in written]


def _repoint(r2t: torch.Tensor, entry: Any, new_slot: int) -> Callable[[], None]:
    """Point ``entry``'s req->token entry at ``new_slot``; returns the undo."""
    r2t[entry.req_pool_idx, entry.position] = new_slot

    def undo() -> None:
        r2t[entry.req_pool_idx, entry.position] = entry.slot

    return undo


def req_to_token(fb: Any, r2t: torch.Tensor, rng: random.Random, step: int) -> Injection | None:
    """Point one committed entry at another live slot of another position (a slot of the
    same position may hold identical content under prefix sharing: no fault at all)."""
    _, entries = _unwritten_prefix(fb, r2t)
    if not entries:
        return None
    victim = rng.choice(entries)
    donors = [e for e in entries if e.position != victim.position and e.slot != victim.slot]
    if not donors:
        return None
    new_slot = rng.choice(donors).slot
    undo = _repoint(r2t, victim, new_slot)
    logger.warning(
        "kv_canary perturb req_to_token: req_pool_idx=%d position=%d original_slot=%d new_slot=%d",
        victim.req_pool_idx, victim.position, victim.slot, new_slot,
    )  # fmt: skip
    return Injection("req_to_token", step, None, {
        "req_pool_idx": victim.req_pool_idx, "position": victim.position,
        "original_slot": victim.slot, "new_slot": new_slot}, undo)  # fmt: skip


def swa_mapping(fb: Any, r2t: torch.Tensor, group: CanaryBufferGroup, rng: random.Random,
                step: int) -> Injection | None:  # fmt: skip
    """Point a live in-window full slot's mapping entry at another live SWA slot."""
    lut = group.swa_index_lut
    assert lut is not None and group.window is not None
    entries = [e for e in prefix_entries(fb, r2t, group.window) if int(lut[e.slot]) > 0]
    if len(entries) < 2:
        return None
    victim = rng.choice(entries)
    original = int(lut[victim.slot])
    donors = [e for e in entries if int(lut[e.slot]) != original]
    if not donors:
        return None
    new = int(lut[rng.choice(donors).slot])
    lut[victim.slot] = new
    logger.warning(
        "kv_canary perturb swa_mapping: req_pool_idx=%d position=%d full_slot=%d "
        "original_swa_slot=%d new_swa_slot=%d",
        victim.req_pool_idx, victim.position, victim.slot, original, new,
    )  # fmt: skip

    def undo() -> None:
        lut[victim.slot] = original

    return Injection("swa_mapping", step, "swa", {
        "req_pool_idx": victim.req_pool_idx, "position": victim.position,
        "full_slot": victim.slot, "original_swa_slot": original, "new_swa_slot": new}, undo)  # fmt: skip


def page_shift(fb: Any, r2t: torch.Tensor, page_size: int, num_slots: int, rng: random.Random,
               step: int) -> Injection | None:  # fmt: skip
    """Shift one request's committed page-table entries by one page (slot +/- page_size),
    as an off-by-one page index would."""
    rows = [(r, k) for r, k in zip(fb.req_pool_indices.tolist(), fb.prefix_lens.tolist(), strict=True)
            if r != 0 and k > 0]  # fmt: skip
    if not rows:
        return None
    row, k = rng.choice(rows)
    original = r2t[row, :k].clone()
    if int(original.max()) + page_size < num_slots:
        shift = page_size
    elif int(original.min()) - page_size >= page_size:  # never into the reserved sink page
        shift = -page_size
    else:
        return None
    r2t[row, :k] = original + shift
    logger.warning(
        "kv_canary perturb page_shift: req_pool_idx=%d positions=[0, %d) shift_slots=%+d "
        "page_size=%d", row, k, shift, page_size,
    )  # fmt: skip

    def undo() -> None:
        r2t[row, :k] = original

    return Injection("page_shift", step, None, {
        "req_pool_idx": row, "num_positions": k, "shift_slots": shift}, undo)  # fmt: skip


def stale_reuse(fb: Any, r2t: torch.Tensor, rng: random.Random, step: int) -> Injection | None:
    """One token this forward writes lands in a live slot of another request (as if that slot
    had been freed and handed out again while still referenced); the writer's own slot is
    lost. Another request's slot when the batch has one, else an earlier slot of its own."""
    writes = write_entries(fb)
    if not writes:
        return None
    w = rng.choice(writes)
    _, entries = _unwritten_prefix(fb, r2t)
    others = [e for e in entries if e.req_pool_idx != w.req_pool_idx] or entries
    if not others:
        return None
    victim = rng.choice(others)
    fb.out_cache_loc[w.token_index] = victim.slot
    r2t[w.req_pool_idx, w.position] = victim.slot
    logger.warning(
        "kv_canary perturb stale_reuse: slot=%d owner_req_pool_idx=%d owner_position=%d "
        "reused_by_req_pool_idx=%d position=%d lost_slot=%d",
        victim.slot, victim.req_pool_idx, victim.position, w.req_pool_idx, w.position, w.slot,
    )  # fmt: skip

    def undo() -> None:
        fb.out_cache_loc[w.token_index] = w.slot
        r2t[w.req_pool_idx, w.position] = w.slot

    return Injection("stale_reuse", step, None, {
        "slot": victim.slot, "owner_req_pool_idx": victim.req_pool_idx,
        "owner_position": victim.position, "reused_by_req_pool_idx": w.req_pool_idx,
        "position": w.position, "lost_slot": w.slot}, undo)  # fmt: skip


def next_token_swap(running: Sequence[Any], override_next_token: Callable[[int, int], None],
                    rng: random.Random, step: int) -> Injection | None:  # fmt: skip
    """Swap the freshly sampled (not yet fed) next tokens of two running requests, as a
    sampler returning rows in the wrong order would. ``running``: snapshots with ``rid``,
    ``req_pool_idx``, ``prompt_ids``, ``output_ids``, ``kv_len``; ``override_next_token(rid,
    token)``: the host replaces a request's last sampled token (its token mirror follows)."""
    ready = [r for r in running if r.output_ids and r.req_pool_idx != 0  # one decode continues it
             and r.kv_len == len(r.prompt_ids) + len(r.output_ids) - 1]  # fmt: skip
    pairs = [(a, b) for i, a in enumerate(ready) for b in ready[i + 1 :]
             if a.output_ids[-1] != b.output_ids[-1]]  # fmt: skip
    if not pairs:
        return None
    a, b = rng.choice(pairs)
    ta, tb = a.output_ids[-1], b.output_ids[-1]
    override_next_token(a.rid, tb)
    override_next_token(b.rid, ta)
    logger.warning(
        "kv_canary perturb next_token_swap: swapped rids=(%d, %d) req_pool_idx=(%d, %d) "
        "tokens=(%d, %d) -> (%d, %d)", a.rid, b.rid, a.req_pool_idx, b.req_pool_idx, ta, tb, tb, ta,
    )  # fmt: skip
    return Injection("next_token_swap", step, None, {
        "rid_a": a.rid, "rid_b": b.rid, "token_a": ta, "token_b": tb})  # fmt: skip


def premature_window_eviction(fb: Any, r2t: torch.Tensor, group: CanaryBufferGroup,
                              rng: random.Random, step: int) -> Injection | None:  # fmt: skip
    """Zero the mapping of one whole in-window page of a running request (positions attention
    reads: ``[prefix_len - window + 1, prefix_len)``), as a frontier a few pages too far would."""
    lut = group.swa_index_lut
    if lut is None or group.window is None:
        return None
    entries = [e for e in prefix_entries(fb, r2t, group.window - 1) if int(lut[e.slot]) > 0]
    if not entries:
        return None
    victim = rng.choice(entries)
    page = victim.slot // group.page_size
    full = [page * group.page_size + i for i in range(group.page_size)]
    original = [int(lut[f]) for f in full]
    for f in full:
        lut[f] = 0
    logger.warning(
        "kv_canary perturb premature_window_eviction: req_pool_idx=%d position=%d full_slots=%s "
        "original_swa_slots=%s", victim.req_pool_idx, victim.position, full, original,
    )  # fmt: skip

    def undo() -> None:
        for f, o in zip(full, original, strict=True):
            lut[f] = o

    return Injection("premature_window_eviction", step, "swa", {
        "req_pool_idx": victim.req_pool_idx, "position": victim.position,
        "full_slot": victim.slot}, undo)  # fmt: skip


def lost_kv_store(fb: Any, group: CanaryBufferGroup, pool: Any, rng: random.Random,
                  step: int, group_name: str) -> Injection | None:  # fmt: skip
    """Undo, right after attention made it, the store of one token this forward writes into
    the group's first fingerprinted layer (the store below any hook: the bytes never land)."""
    sources = group.real_kv_sources_k
    writes = [w for w in write_entries(fb) if group_slot(group, w.slot) > 0]
    if not sources or not writes:
        return None
    target = rng.choice(writes)
    slot = group_slot(group, target.slot)
    owner = kv_buffer_owners(pool).get(sources[0].tensor.data_ptr())
    if owner is None:
        return None
    sub, layer, _ = owner
    buf = sub.k_buffer[layer]
    old = buf[slot].clone()
    store = sub.set_kv_buffer

    def lossy_store(layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: Any, *a: Any, **kw: Any) -> Any:
        out = store(layer_id, loc, k, v, *a, **kw)
        if layer_id == layer:
            buf[slot] = old
        return out

    sub.set_kv_buffer = lossy_store
    logger.warning(
        "kv_canary perturb lost_kv_store: group=%s req_pool_idx=%d position=%d slot=%d",
        group_name, target.req_pool_idx, target.position, slot,
    )  # fmt: skip

    def undo() -> None:
        sub.set_kv_buffer = store

    return Injection("lost_kv_store", step, group_name, {
        "req_pool_idx": target.req_pool_idx, "position": target.position, "slot": slot}, undo)  # fmt: skip


# ---------------------------------------------------------------------- speculative decoding
def draft_position_shift(fb: Any, rng: random.Random, step: int) -> Injection | None:
    """One row of a draft decode forward (one token per row) at position + 1: its KV (and
    record) written one position off, as SGLang's EAGLE draft positions were (#25015)."""
    if set(fb.extend_seq_lens.tolist()) != {1}:
        return None
    writes = write_entries(fb)
    if not writes:
        return None
    w = rng.choice(writes)
    fb.positions[w.token_index] = w.position + 1
    logger.warning(
        "kv_canary perturb draft_position_shift: req_pool_idx=%d position=%d slot=%d "
        "written_as_position=%d", w.req_pool_idx, w.position, w.slot, w.position + 1,
    )  # fmt: skip

    def undo() -> None:
        fb.positions[w.token_index] = w.position

    return Injection("draft_position_shift", step, None, {
        "req_pool_idx": w.req_pool_idx, "position": w.position, "slot": w.slot}, undo)  # fmt: skip


def draft_chunk_rotation(fb: Any, token_table: torch.Tensor, token_lens: torch.Tensor,
                         rng: random.Random, step: int) -> Injection | None:  # fmt: skip
    """The input id of the last position of one non-final chunk of an extend (the draft's
    catch-up prefill) replaced by the next position's token, as inputs rotated one too far
    at a chunk boundary would be (SGLang #26329). Permanent: the KV is computed from it."""
    writes = write_entries(fb)
    last: dict[int, WriteEntry] = {}
    for w in writes:
        last[w.req_pool_idx] = w
    cands = []
    for w in last.values():
        nxt = w.position + 1
        if nxt < int(token_lens[w.req_pool_idx]):  # a non-final chunk
            token = int(token_table[w.req_pool_idx, nxt])
            if token != int(fb.input_ids[w.token_index]):
                cands.append((w, token))
    if not cands:
        return None
    w, token = rng.choice(cands)
    original = int(fb.input_ids[w.token_index])
    fb.input_ids[w.token_index] = token
    logger.warning(
        "kv_canary perturb draft_chunk_rotation: req_pool_idx=%d position=%d slot=%d "
        "original_token=%d new_token=%d", w.req_pool_idx, w.position, w.slot, original, token,
    )  # fmt: skip
    return Injection("draft_chunk_rotation", step, None, {
        "req_pool_idx": w.req_pool_idx, "position": w.position, "slot": w.slot,
        "original_token": original, "new_token": token})  # fmt: skip


def rejected_kv_kept(fb: Any, rejections: Sequence[tuple[int, int]], free_slot: int,
                     rng: random.Random, step: int) -> Injection | None:  # fmt: skip
    """After a verify step that rejected drafts, one request's bonus token (its first write
    this forward, at the first rejected position) goes to ``free_slot`` while its req->token
    entry keeps the slot that still holds the rejected draft's KV: the next read takes the
    rejected draft as accepted."""
    rejected = set(rejections)
    writes = [w for w in write_entries(fb) if (w.req_pool_idx, w.position) in rejected]
    if not writes or free_slot <= 0:
        return None
    w = rng.choice(writes)
    fb.out_cache_loc[w.token_index] = free_slot
    logger.warning(
        "kv_canary perturb rejected_kv_kept: req_pool_idx=%d position=%d kept_slot=%d "
        "bonus_written_to=%d", w.req_pool_idx, w.position, w.slot, free_slot,
    )  # fmt: skip

    def undo() -> None:
        fb.out_cache_loc[w.token_index] = w.slot

    return Injection("rejected_kv_kept", step, None, {
        "req_pool_idx": w.req_pool_idx, "position": w.position, "slot": w.slot,
        "bonus_slot": free_slot}, undo)  # fmt: skip


def rollback_frees_cached(fb: Any, give_cached_page: Callable[..., Any], page_size: int,
                          rng: random.Random, step: int) -> tuple[Injection, Callable[[], None]] | None:  # fmt: skip
    """A page an unlocked prefix-cache node holds is handed to one request as the fresh page
    this forward starts writing (a rollback freed it while the tree still held it, the
    allocator gave it out again): the forward overwrites the cached KV. The host remaps the
    row (``give_cached_page(row, position, choose)``); the forward's out_cache_loc follows.
    Returns the injection and the host's repair (run after the radix sweep read the page)."""
    writes = [w for w in write_entries(fb) if w.position % page_size == 0]
    if not writes:
        return None
    w = rng.choice(writes)
    given = give_cached_page(w.req_pool_idx, w.position, rng.choice)
    if given is None:
        return None
    remap, repair = given
    locs = fb.out_cache_loc
    for i, slot in enumerate(locs.tolist()):
        if slot in remap:
            locs[i] = remap[slot]
    new = remap[w.slot]
    logger.warning(
        "kv_canary perturb rollback_frees_cached: req_pool_idx=%d position=%d own_slot=%d "
        "cached_slot=%d", w.req_pool_idx, w.position, w.slot, new,
    )  # fmt: skip
    return Injection("rollback_frees_cached", step, None, {
        "req_pool_idx": w.req_pool_idx, "position": w.position, "own_slot": w.slot,
        "slot": new}), repair  # fmt: skip


def draft_page_leak(fb: Any, r2t: torch.Tensor, draft_slots: Sequence[int], num_slots: int,
                    rng: random.Random, step: int) -> Injection | None:  # fmt: skip
    """One committed req->token entry of a target request -> a slot the draft model's
    allocator holds (an index into the draft's pool read in the target's), as a target that
    took a page from the draft's allocator would hold."""
    written, entries = _unwritten_prefix(fb, r2t)
    if not entries or not draft_slots:
        return None
    victim = rng.choice(entries)
    same_position = {e.slot for e in entries if e.position == victim.position}
    cands = sorted({s for s in draft_slots if 0 < s < num_slots} - written - same_position)
    if not cands:
        return None
    new_slot = rng.choice(cands)
    undo = _repoint(r2t, victim, new_slot)
    logger.warning(
        "kv_canary perturb draft_page_leak: req_pool_idx=%d position=%d original_slot=%d "
        "draft_slot=%d", victim.req_pool_idx, victim.position, victim.slot, new_slot,
    )  # fmt: skip
    return Injection("draft_page_leak", step, None, {
        "req_pool_idx": victim.req_pool_idx, "position": victim.position,
        "original_slot": victim.slot, "slot": new_slot}, undo)  # fmt: skip
