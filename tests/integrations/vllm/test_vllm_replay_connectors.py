"""Replays of fixed vLLM bugs on the paths where another KV connector loads KV (an offload
tier, P/D disaggregation), caught by the canary beside it. vLLM's ``MultiConnector`` runs
a loading stub (``vllm_stub_connector.py``, the canary listed last): its "remote" KV was
computed by a donor engine of the same checkpoint (a prefill instance) and is loaded into
the blocks vLLM allocates, synchronously or asynchronously; the canary seals the loaded
slots (writes their records, trusting the loader) once a load completed, and never seals
a block the loader reported failed (docs/VLLM.md, "KV loaded by another connector").

Each bug is put back with ``revert_fix`` (the exact lines of the upstream fix replaced by
the pre-fix lines; a version drift fails loudly). Runs: unpatched with the canary (silent,
the read oracle clean: the loads are sealed); patched without the canary (the victim's
output differs from the clean run's, the oracle counts bad reads); patched with the canary
(reported in the step of the first bad read, every bad read's slot named, the launch tag,
fail reasons and ``kvcanary explain``'s cause checked). :data:`TABLE` keeps each bug's
figures (printed).

    bug                                      fix site (0.32)                        form
    #26813 a failed KV load leaves its       Scheduler._handle_invalid_blocks:      exact lines
      blocks in the prefix cache (fail         the eviction of the failed blocks    (pre-fix: the
      policy): the next request with the       and their successors                 PR's earlier
      prefix hits a never-loaded block                                              revision)
    #32255 an aborted async load keeps       Scheduler.finish_requests (delayed     closest form:
      writing into the blocks vLLM freed       free) + _update_from_kv_xfer_        the transfer
      and gave to another request              finished                             lands late
    #34616 after an async load ending        Scheduler._update_waiting_for_         closest form:
      mid-block, num_computed_tokens counts    remote_kv                            a stub async
      the block's unloaded rest as computed                                         load of 40
    #44409 a connector's external tokens     KVCacheCoordinator.allocate_new_       closest form:
      make one group take another group's      computed_blocks (two-phase order)    stub tokens,
      untouched cache-hit block (Gemma3)                                            LRU staged
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import vllm_harness as H
import vllm_replay as R
import vllm_stub_connector as S
from source_patch import revert_fix

CANARY = {"mode": "log", "real_data": "partial"}
TABLE: dict[str, dict[str, Any]] = {}
BS = H.BLOCK_SIZE


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 300) for _ in range(n)]


P1 = _prompt(41, 100)  # #26813
P2, Q2 = _prompt(42, 100), _prompt(43, 90)  # #32255 (and the async failure test)
P3 = _prompt(44, 100)  # #34616: the prefill instance had only P3[:40]
P4, TAIL4 = _prompt(45, 128), _prompt(46, 40)  # #44409 (Gemma3)


def _drive(llm: Any, tick: Callable[[], list[Any]], info: dict[str, Any],
           limit: int = 200) -> dict[str, list[int]]:  # fmt: skip
    """Step until every request finished; outputs by user request id (finish reasons
    into ``info["reasons"]``)."""
    outputs: dict[str, list[int]] = {}
    for _ in range(limit):
        if not llm.llm_engine.has_unfinished_requests():
            break
        for out in tick():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
                info.setdefault("reasons", {})[out.request_id] = out.outputs[0].finish_reason
    return outputs


def _canary_stats(llm: Any, info: dict[str, Any]) -> None:
    with contextlib.suppress(StopIteration):
        info["stats"] = H.connector(llm).worker.stats()


@pytest.fixture(scope="module")
def donors(checkpoints: dict[str, Path]) -> Iterator[dict[str, list[int]]]:
    """The prefill instances: each prompt run alone in an engine whose stub stores the KV of
    the ``donor`` requests' prompts; the ``ref`` requests are plain outputs (not stored).
    Returns every request's output."""
    S.STORE.clear()
    outputs: dict[str, list[int]] = {}
    runs = {"llama": [("donor-p1", P1, 6), ("donor-p2", P2, 8), ("donor-p3", P3[:40], 2),
                      ("ref-p3", P3, 6)],
            "gemma3": [("donor-p4", P4, 2), ("ref-p4", P4 + TAIL4, 8)]}  # fmt: skip
    for family, requests in runs.items():
        with H.vllm_engine(checkpoints[family], connectors=[S.transfer_config(save="donor")],
                           num_blocks=80) as llm:  # fmt: skip
            for rid, prompt, n in requests:
                H.add_request(llm, rid, prompt, n)
                while llm.llm_engine.has_unfinished_requests():
                    for out in H.step(llm):
                        if out.finished:
                            outputs[out.request_id] = list(out.outputs[0].token_ids)
    assert len(S.STORE) == 100 + 100 + 40 + 128  # every donor prompt position
    yield outputs
    S.STORE.clear()


@pytest.fixture(scope="module", autouse=True)
def _print_table() -> Iterator[None]:
    yield
    for name, row in TABLE.items():  # the module's figures, once its replays ran
        print(f"{name}: {row}")


def _three_runs(ckpt: Path, make: Callable[[dict[str, Any]], R.Workload],
                patch: Callable[[], contextlib.AbstractContextManager[Any]],
                connectors: list[dict[str, Any]], **engine: Any,
                ) -> tuple[tuple[R.Run, dict[str, Any]], ...]:  # fmt: skip
    """Unpatched with the canary, patched without, patched with: each (run, its info)."""
    out = []
    for canary, patched in ((CANARY, False), (None, True), (CANARY, True)):
        info: dict[str, Any] = {}
        run = R.replay(ckpt, make(info), canary=canary, patch=patch if patched else None,
                       observe_loads=S.OBSERVERS, connectors=connectors, **engine)  # fmt: skip
        out.append((run, info))
    return tuple(out)


def _common(name: str, clean: R.Run, buggy: R.Run, caught: R.Run, victim: str,
            fix: str, form: str) -> tuple[int, set[int], set[int], list[Any]]:  # fmt: skip
    """The checks every replay makes; (first bad step, its bad slots, the slots the canary
    named in it, its rows). Files the bug's row of :data:`TABLE`."""
    assert not clean.rows and not clean.oracle.bad and clean.oracle.reads > 0, clean.rows
    assert buggy.outputs[victim] != clean.outputs[victim]  # the bug fires
    first_bad = buggy.oracle.first_bad_step
    assert first_bad is not None and buggy.oracle.bad
    assert caught.oracle.first_bad_step == first_bad
    lag = caught.first_detection - first_bad if caught.first_detection is not None else None
    assert lag == 0, (caught.first_detection, first_bad)  # in the step of the first bad read
    bad, named = caught.oracle.bad_slots(first_bad), caught.named_slots(first_bad)
    assert bad and bad <= named, sorted(bad - named)  # every bad read's slot named
    rows = caught.rows[first_bad]
    TABLE[name] = {"fix": fix, "form": form, "first_bad_step": first_bad,
                   "detected_step": caught.first_detection, "lag": lag,
                   "bad_reads": len(buggy.oracle.bad), "bad_slots": len(bad),
                   "named_slots": len(named), "extra_named": sorted(named - bad),
                   "tags": sorted({r.launch_tag for r in rows}),
                   "reasons": sorted({"+".join(r.fail_reasons) for r in rows}),
                   "cause": caught.causes(first_bad)[0], "causes_all_steps": caught.causes()}  # fmt: skip
    print(f"\n{name}: {TABLE[name]}")
    return first_bad, bad, named, rows


# ------------------------------------------------------------------ #26813


HANDLE_INVALID = ("    if sync_blocks_to_evict and not self.recompute_kv_load_failures:\n"
                  "        self.kv_cache_manager.evict_blocks(sync_blocks_to_evict)\n")  # fmt: skip


def _no_eviction() -> contextlib.AbstractContextManager[Any]:
    from vllm.v1.core.sched.scheduler import Scheduler

    return revert_fix(Scheduler._handle_invalid_blocks, fixed=HANDLE_INVALID, buggy="")


def test_26813_failed_load_blocks_left_in_the_prefix_cache(
    checkpoints: dict[str, Path], donors: dict[str, list[int]]
) -> None:
    """vLLM #26813 (https://github.com/vllm-project/vllm/pull/26813): with
    ``kv_load_failure_policy="fail"`` a request whose sync load fails is finished with an
    error, but before the fix its blocks stayed in the prefix cache, hashed. Here "load-r2"
    (P1) loads 99 tokens and block 1 of the load fails (nothing written there, reported by
    ``get_block_ids_with_load_errors``); then "r3" (P1 again, served by nobody) hits the
    cache. Fixed: only block 0 (32 tokens, loaded fine and sealed) is hit, r3 recomputes the
    rest. Buggy: 96 tokens are hit, block 1 was never loaded: r3 reads it. The canary had
    sealed the load in its step and cleared the failed block's slots before the next one."""

    def make(info: dict[str, Any]) -> R.Workload:
        def workload(llm: Any, tick: Callable[[], list[Any]]) -> dict[str, list[int]]:
            tally = H.tally_scheduler(llm)
            H.add_request(llm, "load-r2", P1, 6)
            out = _drive(llm, tick, info)
            H.add_request(llm, "r3", P1, 6)
            out |= _drive(llm, tick, info)
            stub = H.connector(llm, "StubLoadConnector")
            info.update(hits=tally.hit_tokens, failed=list(stub.reported))
            _canary_stats(llm, info)
            return out

        return workload

    (clean, ci), (buggy, bi), (caught, ki) = _three_runs(
        checkpoints["llama"], make, _no_eviction,
        [S.transfer_config(load="load", fail_blocks=[1])], policy="fail")  # fmt: skip
    for info in (ci, bi, ki):
        assert info["reasons"] == {"load-r2": "error", "r3": "length"}
        assert len(info["failed"]) == 1  # block 1 of the load, reported in its step
    failed = ci["failed"][0]
    failed_slots = {failed * BS + o for o in range(BS)}
    assert ci["hits"] == [0, 32] and bi["hits"] == [0, 96] == ki["hits"]
    assert clean.outputs["r3"] == donors["donor-p1"]  # r3 read loaded (sealed) block 0
    # load-r2's own reads of the failed block, in its step: reported by the loader, vLLM
    # dropped the output (the oracle's "reported", not "bad")
    assert clean.oracle.bad_slots() == set() and {b.slot for b in clean.oracle.reported} == failed_slots
    assert ci["stats"]["sealed"] == 99 and ci["stats"]["cleared"] == BS
    first_bad, bad, named, rows = _common("#26813", clean, buggy, caught, "r3",
                                          "Scheduler._handle_invalid_blocks", "exact")  # fmt: skip
    assert first_bad == clean.oracle.reported[0].step + 1  # r3's first step
    assert bad == failed_slots
    assert named - bad <= {max(bad) + 1}  # at most the chain successor of the failed run
    assert {r.launch_tag for r in rows} >= {"HEAD_K_FULL"}
    assert all("verify_position" in r.fail_reasons for r in rows if r.slot_idx in bad)
    assert caught.causes(first_bad)[0] == "unwritten_slot"


# ------------------------------------------------------------------ #32255


FINISH = ("        delay_free_blocks = False\n"
          "        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:\n"
          "            delay_free_blocks = (\n"
          "                request.request_id not in self.finished_recving_kv_req_ids\n"
          "            )\n"
          "            self.finished_recving_kv_req_ids.discard(request.request_id)\n"
          "            self.failed_recving_kv_req_ids.discard(request.request_id)\n\n"
          "        request.status = finished_status\n"
          "        self._free_request(request, delay_free_blocks=delay_free_blocks)\n")  # fmt: skip
FINISH_BUGGY = "        request.status = finished_status\n        self._free_request(request)\n"
XFER = ("        assert req_id in self.requests\n"
        "        req = self.requests[req_id]\n"
        "        if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:\n"
        "            self.finished_recving_kv_req_ids.add(req_id)\n"
        "            self._set_kv_fetch_stage(req, KV_FETCH_COMPLETED_WAITING)\n"
        "        else:\n"
        "            assert RequestStatus.is_finished(req.status)\n"
        "            self._free_blocks(self.requests[req_id])\n")  # fmt: skip
XFER_BUGGY = ("        self.finished_recving_kv_req_ids.add(req_id)\n"
              "        req = self.requests.get(req_id)\n"
              "        if req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:\n"
              "            self._set_kv_fetch_stage(req, KV_FETCH_COMPLETED_WAITING)\n")  # fmt: skip


LATE_LOADER = S.transfer_config(load="load", delay=3, **{"async": True})  # lands 3 steps on


@contextlib.contextmanager
def _free_on_abort() -> Iterator[None]:
    from vllm.v1.core.sched.scheduler import Scheduler

    with revert_fix(Scheduler.finish_requests, fixed=FINISH, buggy=FINISH_BUGGY), \
            revert_fix(Scheduler._update_from_kv_xfer_finished, fixed=XFER, buggy=XFER_BUGGY):
        yield


def test_32255_aborted_async_load_lands_in_freed_blocks(
    checkpoints: dict[str, Path], donors: dict[str, list[int]]
) -> None:
    """vLLM #32255 (https://github.com/vllm-project/vllm/pull/32255): a request aborted
    while its async load is in flight had its blocks freed at once; the transfer, which
    cannot be called back, still lands in them. Here "load-a" (P2) starts an async load
    landing 3 steps later, is aborted after its first step, and "b" (Q2) arrives. Fixed: the
    blocks are held until the transfer reports done; b gets others. Buggy: b gets load-a's
    freed blocks (vLLM reuses unhashed blocks first), prefills into them, and the late
    transfer overwrites b's KV; b's next step reads it. Closest form: the in-flight
    transfer is the stub's delayed write (no NIXL / RDMA here); the scheduler lines are
    upstream's."""

    def make(info: dict[str, Any]) -> R.Workload:
        def workload(llm: Any, tick: Callable[[], list[Any]]) -> dict[str, list[int]]:
            manager = H.scheduler(llm).kv_cache_manager
            H.add_request(llm, "load-a", P2, 4)
            tick()
            a = H.internal_id(llm, "load-a")
            info["a_blocks"] = set(manager.get_block_ids(a)[0])
            info["a_status"] = H.scheduler(llm).requests[a].status.name
            llm.llm_engine.abort_request(["load-a"])
            H.add_request(llm, "b", Q2, 8)
            tick()
            info["b_blocks"] = set(manager.get_block_ids(H.internal_id(llm, "b"))[0])
            out = _drive(llm, tick, info)
            info["landed"] = [t.rid for t in H.connector(llm, "StubLoadConnector").landed]
            _canary_stats(llm, info)
            return out

        return workload

    (clean, ci), (buggy, bi), (caught, ki) = _three_runs(
        checkpoints["llama"], make, _free_on_abort, [LATE_LOADER])
    for info in (ci, bi, ki):
        assert info["a_status"] == "WAITING_FOR_REMOTE_KVS" and len(info["landed"]) == 1
    assert not ci["b_blocks"] & ci["a_blocks"]  # fixed: held until the transfer is done
    assert bi["b_blocks"] <= bi["a_blocks"] and ki["b_blocks"] <= ki["a_blocks"]
    assert ci["stats"]["cleared"] == 99 and ci["stats"]["sealed"] == 0  # a: never scheduled
    first_bad, bad, named, rows = _common("#32255", clean, buggy, caught, "b",
                                          "Scheduler.finish_requests + _update_from_kv_xfer_finished",
                                          "closest (stub transfer lands late)")  # fmt: skip
    assert {b.req_id.split("-")[0] for b in buggy.oracle.bad} == {"b"}
    assert {r.launch_tag for r in rows} == {"TAIL_K_FULL"}  # records intact: the bytes changed
    assert {r.fail_reasons for r in rows} == {("verify_real_kv_hash",)}
    assert caught.causes(first_bad)[0] == "kv_byte_corruption"
    # Without fingerprints the canary cannot see it: the transfer wrote bytes, no records.
    blind = R.replay(checkpoints["llama"], make({}), canary={**CANARY, "real_data": "none"},
                     patch=_free_on_abort, observe_loads=S.OBSERVERS, connectors=[LATE_LOADER])
    assert blind.oracle.first_bad_step == first_bad and not blind.rows
    TABLE["#32255"]["real_data_none"] = "silent"


# ------------------------------------------------------------------ #34616


AFTER_LOAD = ("        # Now that the blocks are ready, actually cache them.\n"
              "        # This will cache the blocks iff caching is enabled.\n"
              "        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)\n")  # fmt: skip
AFTER_LOAD_BUGGY = (
    "        # Now that the blocks are ready, actually cache them.\n"
    "        (block_ids,) = self.kv_cache_manager.get_block_ids(request.request_id)\n"
    "        num_computed_tokens = len(block_ids) * self.block_size\n"
    "        # Handle the case where num request tokens less than one block.\n"
    "        num_computed_tokens = min(num_computed_tokens, request.num_tokens)\n"
    "        if num_computed_tokens == request.num_tokens:\n"
    "            num_computed_tokens -= 1\n"
    "        # This will cache the blocks iff caching is enabled.\n"
    "        self.kv_cache_manager.cache_blocks(request, num_computed_tokens)\n\n"
    "        # Update the request state for scheduling.\n"
    "        request.num_computed_tokens = num_computed_tokens\n")  # fmt: skip


def _whole_blocks_computed() -> contextlib.AbstractContextManager[Any]:
    from vllm.v1.core.sched.scheduler import Scheduler

    return revert_fix(Scheduler._update_waiting_for_remote_kv, fixed=AFTER_LOAD,
                      buggy=AFTER_LOAD_BUGGY)  # fmt: skip


def test_34616_async_load_ending_mid_block(
    checkpoints: dict[str, Path], donors: dict[str, list[int]]
) -> None:
    """vLLM #34616 (https://github.com/vllm-project/vllm/pull/34616): after an async load
    the scheduler set ``num_computed_tokens = len(block_ids) * block_size``, so a load ending
    inside a block claimed the block's rest as computed. Here the prefill instance had only
    P3[:40]: "load-a" (P3) loads 40 tokens asynchronously (blocks b0, b1; b1 holds 8).
    Fixed: 40 computed, a computes 40..99. Buggy: 64, positions 40..63 (b1 offsets 8..31)
    were never loaded nor computed, a reads them. Llama only (the buggy lines unpack one
    KV cache group). Closest form: the async load is the stub's."""

    def make(info: dict[str, Any]) -> R.Workload:
        def workload(llm: Any, tick: Callable[[], list[Any]]) -> dict[str, list[int]]:
            H.add_request(llm, "load-a", P3, 6)
            tick()
            a = H.internal_id(llm, "load-a")
            info["a_blocks"] = H.scheduler(llm).kv_cache_manager.get_block_ids(a)[0]
            out = _drive(llm, tick, info)
            _canary_stats(llm, info)
            return out

        return workload

    (clean, ci), (buggy, bi), (caught, ki) = _three_runs(
        checkpoints["llama"], make, _whole_blocks_computed,
        [S.transfer_config(load="load", delay=1, **{"async": True})])  # fmt: skip
    assert clean.outputs["load-a"] == donors["ref-p3"]  # 40 loaded tokens, sealed
    assert ci["stats"]["sealed"] == 40 and ci["stats"]["cleared"] == 40
    first_bad, bad, named, rows = _common("#34616", clean, buggy, caught, "load-a",
                                          "Scheduler._update_waiting_for_remote_kv",
                                          "closest (stub async load)")  # fmt: skip
    b1 = ki["a_blocks"][1]
    assert bad == {b1 * BS + o for o in range(8, BS)}  # positions 40..63: never written
    assert named - bad <= {max(bad) + 1}  # and the first computed token's seed (stale)
    assert {r.launch_tag for r in rows} >= {"HEAD_K_FULL"}
    assert all("verify_position" in r.fail_reasons for r in rows if r.slot_idx in bad)
    assert caught.causes(first_bad)[0] == "unwritten_slot"


# ------------------------------------------------------------------ #44409


TWO_PHASE = (
    "    for i, manager in enumerate(self.single_type_managers):\n"
    "        manager.add_local_computed_blocks(\n"
    "            request_id,\n"
    "            new_computed_blocks[i],\n"
    "            num_local_computed_tokens,\n"
    "            num_external_computed_tokens,\n"
    "        )\n"
    "    if num_external_computed_tokens > 0:\n"
    "        for i, manager in enumerate(self.single_type_managers):\n"
    "            manager.allocate_external_computed_blocks(\n"
    "                request_id,\n"
    "                num_local_computed_tokens,\n"
    "                num_external_computed_tokens,\n"
    "                record_for_zeroing=i not in skip_zeroing_group_ids,\n"
    "            )\n")  # fmt: skip
PER_GROUP = (
    "    for i, manager in enumerate(self.single_type_managers):\n"
    "        manager.add_local_computed_blocks(\n"
    "            request_id,\n"
    "            new_computed_blocks[i],\n"
    "            num_local_computed_tokens,\n"
    "            num_external_computed_tokens,\n"
    "        )\n"
    "        if num_external_computed_tokens > 0:\n"
    "            manager.allocate_external_computed_blocks(\n"
    "                request_id,\n"
    "                num_local_computed_tokens,\n"
    "                num_external_computed_tokens,\n"
    "                record_for_zeroing=i not in skip_zeroing_group_ids,\n"
    "            )\n")  # fmt: skip


def _per_group_allocation() -> contextlib.AbstractContextManager[Any]:
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

    return revert_fix(KVCacheCoordinator.allocate_new_computed_blocks, fixed=TWO_PHASE,
                      buggy=PER_GROUP)  # fmt: skip


def test_44409_external_allocation_takes_another_groups_hit_block(
    checkpoints: dict[str, Path], donors: dict[str, list[int]]
) -> None:
    """vLLM #44409 (https://github.com/vllm-project/vllm/pull/44409): with a local prefix
    hit plus external tokens, the coordinator touched one group's hit blocks and allocated
    its external blocks before touching the next group's: an allocation could pop another
    group's cache hit off the free queue (its hash evicted) and both groups got the one
    physical block. Gemma3 (groups 0-2 sliding, 3 full, one storage): "a" (P4 + 10 decoded)
    runs to completion; the full group's block for positions 32..63 is moved to the head of
    the free queue (the LRU order a longer history of frees leaves); "load-b" (P4 + 40)
    hits 96 tokens locally and the stub serves 96..127. Fixed: every group touches its hits
    first. Buggy: group 0 takes that block for its external tokens; the load (and its
    layer's KV) overwrites what the full group reads as positions 32..63. Closest form: the
    external tokens are the stub's, the free-queue order is staged."""

    def make(info: dict[str, Any]) -> R.Workload:
        def workload(llm: Any, tick: Callable[[], list[Any]]) -> dict[str, list[int]]:
            manager, pool = H.scheduler(llm).kv_cache_manager, H.block_pool(llm)
            tally = H.tally_scheduler(llm)
            H.add_request(llm, "a", P4, 10)
            tick()
            a_blocks = manager.get_block_ids(H.internal_id(llm, "a"))
            out = _drive(llm, tick, info)
            stolen = pool.blocks[a_blocks[3][1]]  # the full group: positions 32..63
            assert stolen.block_hash is not None and stolen.ref_cnt == 0
            pool.free_block_queue.remove(stolen)
            pool.free_block_queue.prepend_n([stolen])
            info["stolen"] = stolen.block_id
            H.add_request(llm, "load-b", P4 + TAIL4, 8)
            tick()
            ids = manager.get_block_ids(H.internal_id(llm, "load-b"))
            groups: dict[int, set[int]] = {}
            for g, row in enumerate(ids):
                for b in row:
                    if b:
                        groups.setdefault(b, set()).add(g)
            info["shared"] = {b: sorted(gs) for b, gs in groups.items() if len(gs) > 1}
            info["hits"] = tally.hit_tokens
            out |= _drive(llm, tick, info)
            _canary_stats(llm, info)
            return out

        return workload

    (clean, ci), (buggy, bi), (caught, ki) = _three_runs(
        checkpoints["gemma3"], make, _per_group_allocation,
        [S.transfer_config(load="load")], num_blocks=80)  # fmt: skip
    for info in (ci, bi, ki):
        assert info["hits"] == [0, 96]
    assert ci["shared"] == {} and clean.outputs["load-b"] == donors["ref-p4"]
    assert ci["stats"]["sealed"] > 0
    stolen = bi["stolen"]
    assert bi["shared"] == {stolen: [0, 3]} == ki["shared"]  # one block, two groups
    assert clean.outputs["a"] == buggy.outputs["a"]
    first_bad, bad, named, rows = _common("#44409", clean, buggy, caught, "load-b",
                                          "KVCacheCoordinator.allocate_new_computed_blocks",
                                          "closest (stub external tokens, staged LRU)")  # fmt: skip
    assert bad == {stolen * BS + o for o in range(BS)}
    assert {b.group for b in caught.oracle.bad if b.step == first_bad} == {3}  # the full group
    assert named - bad <= {max(bad) + 1}
    assert {r.launch_tag for r in rows} >= {"HEAD_K_FULL"}
    assert all("verify_position" in r.fail_reasons for r in rows if r.slot_idx in bad)
    assert caught.causes(first_bad)[0] == "wrong_slot"


# ------------------------------------------------------------------ loads that fail


def test_an_async_load_with_a_failed_block_is_sealed_up_to_it(
    checkpoints: dict[str, Path], donors: dict[str, list[int]]
) -> None:
    """An async load whose block 1 fails (``kv_load_failure_policy="recompute"``): vLLM
    resumes the request from that block; the canary seals only the 32 positions before it
    (the failed block's slots stay cleared until the request recomputes them), the run is
    silent and its output is the plain one."""
    info: dict[str, Any] = {}

    def workload(llm: Any, tick: Callable[[], list[Any]]) -> dict[str, list[int]]:
        tally = H.tally_scheduler(llm)
        H.add_request(llm, "load-x", P2, 8)
        out = _drive(llm, tick, info)
        info["failed"] = list(H.connector(llm, "StubLoadConnector").reported)
        info["hits"] = tally.hit_tokens
        _canary_stats(llm, info)
        return out

    run = R.replay(checkpoints["llama"], workload, canary=CANARY, observe_loads=S.OBSERVERS,
                   connectors=[S.transfer_config(load="load", fail_blocks=[1], delay=1,
                                                 **{"async": True})],
                   policy="recompute")  # fmt: skip
    assert len(info["failed"]) == 1 and info["reasons"] == {"load-x": "length"}
    assert not run.rows and not run.oracle.bad and not run.oracle.reported
    assert run.outputs["load-x"] == donors["donor-p2"]
    assert info["stats"]["cleared"] == 99 and info["stats"]["sealed"] == BS
