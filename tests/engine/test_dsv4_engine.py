"""DeepSeek-V4 on the engine, against transformers' ``DeepseekV4ForCausalLM`` (eager, fp32).

Parity: tokens identical and logits within ``LOGIT_TOL`` (measured max |diff| ~3e-4 on
logits of magnitude ~100) for prompts crossing several C128 boundaries, through unaligned
chunked prefill, batching, window eviction, retraction (recompute and host offload) and
the prefix cache. The memory contract: after a forward the compress-state ring rows of a
request's live tail hold exactly the per-token compressor state transformers' cache
buffers hold, and the compressed entries equal transformers' compressed KV; corrupting a
C4 / C128 / indexer entry or a live-tail ring row changes the next logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dsv4_fixtures import VOCAB_SIZE, load_hf_dsv4, make_tiny_dsv4_checkpoint
from engine_utils import assert_all_memory_free

from kvcanary import Engine, EngineConfig, SamplingParams
from kvcanary.canary.config import CanaryConfig
from kvcanary.cli.run import canary_summary, run_workload
from kvcanary.engine.args import default_page_size
from kvcanary.memory import host_pool
from kvcanary.memory.dsv4_pool import DSV4KVPool
from kvcanary.model import deepseek_v4
from kvcanary.workload import WorkloadSpec

LOGIT_TOL = 2e-3
NEW_TOKENS = 10
PROMPT_LENS = (330, 301, 140)  # 330, 301 cross two C128 boundaries; 140 one


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_dsv4_checkpoint(tmp_path_factory.mktemp("dsv4"))


@pytest.fixture(scope="module")
def hf(ckpt: Path) -> Any:
    return load_hf_dsv4(ckpt)


def prompts(lens: tuple[int, ...] = PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB_SIZE - 2, (n,), generator=g).tolist() for n in lens]


def engine(ckpt: Path, **overrides: Any) -> Engine:
    base: dict[str, Any] = dict(model=str(ckpt), page_size=128, max_total_tokens=4096,
                                swa_full_tokens_ratio=1.0, chunked_prefill_size=37,
                                enable_prefix_cache=False)  # fmt: skip
    base.update(overrides)
    return Engine(EngineConfig(**base))


def record_logits(e: Engine) -> dict[tuple[int, int], torch.Tensor]:
    """``(rid, seq_len) -> logits`` of every forward from now on."""
    rec: dict[tuple[int, int], torch.Tensor] = {}
    forward = e.runner.forward

    def wrapped(fb: Any, static: Any = None) -> torch.Tensor:
        logits = forward(fb, static)
        for i, (rid, seq_len) in enumerate(zip(fb.rids, fb.seq_lens_cpu, strict=True)):
            rec[(rid, seq_len)] = logits[i].clone()
        return logits

    e.runner.forward = wrapped  # type: ignore[method-assign]
    return rec


def assert_parity(hf: Any, e: Engine, ps: list[list[int]], new_tokens: int = NEW_TOKENS) -> float:
    """Generate greedily; each sampled token's logits must match transformers' on the same
    sequence (one unchunked forward) and be its argmax. Returns the max |logit diff|."""
    rec = record_logits(e)
    outs = e.generate(ps, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    worst = 0.0
    for out in outs:
        n = len(out.prompt_ids)
        with torch.no_grad():
            ref = hf(torch.tensor([out.prompt_ids + out.output_ids[:-1]])).logits[0, n - 1 :]
        ours = torch.stack([rec[(out.rid, n + i)] for i in range(new_tokens)])
        assert out.output_ids == ref.argmax(-1).tolist()
        worst = max(worst, float((ours - ref).abs().max()))
    assert worst < LOGIT_TOL
    return worst


@pytest.mark.parametrize(
    "overrides",
    [
        dict(chunked_prefill_size=0),  # whole prompts, batched
        dict(chunked_prefill_size=37),  # chunks never aligned with a window (4, 128)
        # SWA pool of 3 pages: requests run partly one after another, windows evicted
        dict(chunked_prefill_size=37, max_total_tokens=2048, swa_full_tokens_ratio=0.1875),
    ],
    ids=["unchunked", "chunked37", "chunked37-evicting"],
)
def test_greedy_parity_with_transformers(ckpt: Path, hf: Any, overrides: dict[str, Any]) -> None:
    e = engine(ckpt, **overrides)
    assert isinstance(e.runner.token_to_kv_pool, DSV4KVPool)
    assert_parity(hf, e, prompts())
    if overrides.get("swa_full_tokens_ratio", 1.0) < 1.0:
        assert e.stats.num_swa_slots_evicted > 0
    assert_all_memory_free(e)


def test_retraction_recompute_and_host_offload(
    ckpt: Path, hf: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full pool too small for every request's decode at once: the newest is retracted,
    then recomputed (or its KV -- latent window, compressed entries, ring tails -- reloaded
    from the host copy) -- same tokens and logits."""
    loads: list[int] = []
    load = host_pool.load_cpu_copy
    monkeypatch.setattr(host_pool, "load_cpu_copy",
                        lambda pool, copy, slots: (loads.append(slots.numel()), load(pool, copy, slots)))  # fmt: skip
    for offload in (False, True):
        e = engine(ckpt, max_total_tokens=1024, enable_host_offload=offload, chunked_prefill_size=0)
        assert_parity(hf, e, prompts((250, 250, 250), seed=3), new_tokens=16)
        assert e.stats.num_retractions > 0
        assert bool(loads) == offload  # the copy was restored, not dropped for a recompute
        assert_all_memory_free(e)


def test_prefix_cache_resumes_at_page_boundaries(ckpt: Path, hf: Any) -> None:
    """Cached prefixes are whole pages (multiples of 128): the resumed request's C4
    overlap rows are the cached page's last ring rows, its C128 live tail is empty."""
    shared = prompts((300,), seed=5)[0]
    tails = prompts((20, 41, 7), seed=6)
    e = engine(ckpt, enable_prefix_cache=True)
    assert_parity(hf, e, [shared + tails[0]])
    outs_before = e.stats.num_cached_prompt_tokens
    assert_parity(hf, e, [shared + t for t in tails[1:]])
    assert e.stats.num_cached_prompt_tokens - outs_before == 2 * 256
    assert_all_memory_free(e)


def _running_slots(e: Engine, position: int) -> tuple[int, int]:
    row = e.running_requests()[0].req_pool_idx
    full = int(e.runner.req_to_token_pool.req_to_token[row, position])
    return full, int(e.runner.token_to_kv_pool.full_to_swa_index_mapping[full])


def _prefill(e: Engine, prompt: list[int]) -> None:
    e.add_request(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
    while not e.running_requests() or e.running_requests()[0].kv_len < len(prompt):
        assert e.step() == []


def test_ring_rows_and_entries_match_transformers_cache(ckpt: Path, hf: Any) -> None:
    prompt = prompts((301,), seed=7)[0]
    length = len(prompt)
    with torch.no_grad():
        cache = hf(torch.tensor([prompt]), use_cache=True).cache
    e = engine(ckpt)
    _prefill(e, prompt)
    pool = e.runner.token_to_kv_pool
    assert isinstance(pool, DSV4KVPool)
    model = e.runner.model
    assert isinstance(model, deepseek_v4.DeepseekV4Decoder)
    checked = 0
    for lid, entry in enumerate(pool.layer_mapping):
        ratio, layer = entry.ratio, cache.layers[lid]
        if ratio == 0:
            continue
        comp = model.layers[lid].self_attn.compressor
        parts = [("compressor", comp, pool.get_state_buffer(lid), pool.get_compressed_buffer(lid))]
        if ratio == 4:
            parts.append(("indexer", comp.indexer, pool.get_indexer_state_buffer(lid),
                          pool.get_indexer_buffer(lid)))  # fmt: skip
        for name, module, ring, entries in parts:
            dim = module.dim
            # Compressed entries: rows full // ratio of each window's first position.
            rows = [_running_slots(e, w * ratio)[0] // ratio for w in range(length // ratio)]
            torch.testing.assert_close(entries[rows], layer.compressed_kv[name][0], atol=2e-5, rtol=0)
            # Ring rows of the live tail: the open window's raw states (kv, gate + bias) ...
            open_start = length - length % ratio
            width = ring.shape[1] // 2
            for k, p in enumerate(range(open_start, length)):
                row = ring[pool.state_loc(lid, torch.tensor(_running_slots(e, p)[1]))]
                bias = module.position_bias[p % ratio]
                torch.testing.assert_close(row[:width], layer.buffer_kv[name][0, k], atol=2e-5, rtol=0)
                torch.testing.assert_close(row[width:] - bias, layer.buffer_gate[name][0, k],
                                           atol=2e-5, rtol=0)  # fmt: skip
                checked += 1
            if ratio == 4:  # ... and, for the overlap, the previous window's Ca series
                for k, p in enumerate(range(open_start - 4, open_start)):
                    row = ring[pool.state_loc(lid, torch.tensor(_running_slots(e, p)[1]))]
                    torch.testing.assert_close(row[:dim], layer.overlap_kv[name][0, k], atol=2e-5, rtol=0)
                    torch.testing.assert_close(row[2 * dim : 3 * dim], layer.overlap_gate[name][0, k],
                                               atol=2e-5, rtol=0)  # fmt: skip
                    checked += 1
    assert checked == 2 * (1 + 4) * 2 + 301 % 128  # C4 x2 (attention + indexer) x2 layers, C128


def _selected_entries(e: Engine, layer_id: int) -> list[int]:
    """The C4 entries the next decode query of ``layer_id`` keeps (one recorded step)."""
    seen: list[int] = []
    select = deepseek_v4.Indexer.select

    def spy(self: Any, lid: int, *args: Any) -> torch.Tensor:
        out = select(self, lid, *args)
        if lid == layer_id:
            seen.extend(out[0, -1].nonzero().reshape(-1).tolist())
        return out

    deepseek_v4.Indexer.select = spy  # type: ignore[method-assign]
    try:
        e.step()
    finally:
        deepseek_v4.Indexer.select = select  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("target", ["c4", "c128", "indexer", "c4_ring", "c128_ring", "indexer_ring"])
def test_corrupting_a_row_changes_the_next_logits(ckpt: Path, target: str) -> None:
    """The decode at position 383 completes a C4 window [380, 384) (its Ca from ring rows
    376..379, Cb from 380..382) and a C128 window [256, 384) (ring rows 256..382), and reads
    visible entry the indexer keeps: a corrupted row must show in its logits. The indexer
    rarely keeps the newest C4 entry, so for the C4 ring both engines keep every entry."""
    prompt = prompts((383,), seed=9)[0]
    clean, dirty = engine(ckpt), engine(ckpt)
    for e in (clean, dirty):
        _prefill(e, prompt)
        if target == "c4_ring":
            for layer in e.runner.model.layers:
                indexer = layer.self_attn.compressor and layer.self_attn.compressor.indexer
                if indexer:
                    indexer.topk = 1000
    pool = dirty.runner.token_to_kv_pool
    assert isinstance(pool, DSV4KVPool)
    c4_layer, c128_layer = pool.compression_ratios.index(4), pool.compression_ratios.index(128)
    rec_clean, rec_dirty = record_logits(clean), record_logits(dirty)
    kept = _selected_entries(clean, c4_layer)  # the clean decode step
    # Entries visible to the query at 383: windows 0..95; the indexer keeps 8 (all: C4 ring).
    assert len(kept) == (96 if target == "c4_ring" else 8)
    if target in ("c4", "indexer"):  # an entry the indexer keeps for this query
        row = _running_slots(dirty, kept[0] * 4)[0] // 4
        if target == "c4":
            pool.get_compressed_buffer(c4_layer)[row] *= -1
        else:
            pool.get_indexer_buffer(c4_layer)[row] = 0.0
    elif target == "c128":
        pool.get_compressed_buffer(c128_layer)[_running_slots(dirty, 128)[0] // 128] *= -1
    else:
        layer = c128_layer if target == "c128_ring" else c4_layer
        position = {"c4_ring": 378, "indexer_ring": 381, "c128_ring": 300}[target]
        ring = pool.get_indexer_state_buffer(layer) if target == "indexer_ring" else pool.get_state_buffer(layer)
        row = pool.state_loc(layer, torch.tensor(_running_slots(dirty, position)[1]))
        ring[row, : ring.shape[1] // 2] += 3.0  # the kv half
    dirty.step()
    key = (dirty.running_requests()[0].rid, len(prompt) + 1)
    diff = float((rec_clean[key] - rec_dirty[key]).abs().max())
    assert diff > 1e-2, f"corrupting {target} left the logits unchanged (max diff {diff})"


def test_canary_raise_with_real_data_is_silent(ckpt: Path) -> None:
    """--kv-canary raise --kv-canary-real-data partial over >= 300-token prompts with decode
    (chunked, evicting, prefix cache on): no violation raised, entries written."""
    config = EngineConfig(model="builtin:tiny-dsv4", page_size=128, max_total_tokens=2048,
                          swa_full_tokens_ratio=0.25, chunked_prefill_size=37,
                          canary=CanaryConfig(mode="raise", real_data="partial"))  # fmt: skip
    summary, e = run_workload(config, WorkloadSpec(3, 320, 12, 130, 0), progress=False)
    assert summary["canary_violations"] == 0
    assert summary["canary_write_entries"] > 0
    assert summary["prefix_cache_hit_rate"] > 0
    assert_all_memory_free(e)


def test_canary_rides_through_retraction_with_host_offload(monkeypatch: pytest.MonkeyPatch) -> None:
    """Canary raise + real-data partial with requests retracted and restored from host
    copies: the records of every sub-pool (rings included) travel with the copy, so the
    restored requests verify clean; every group wrote its records."""
    loads: list[int] = []
    load = host_pool.load_cpu_copy
    monkeypatch.setattr(host_pool, "load_cpu_copy",
                        lambda pool, copy, slots: (loads.append(slots.numel()), load(pool, copy, slots)))  # fmt: skip
    e = Engine(EngineConfig(model="builtin:tiny-dsv4", page_size=128, max_total_tokens=1024,
                            swa_full_tokens_ratio=1.0, chunked_prefill_size=0,
                            enable_prefix_cache=False, enable_host_offload=True,
                            canary=CanaryConfig(mode="raise", real_data="partial")))  # fmt: skip
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(0, 256, (250,), generator=g).tolist() for _ in range(3)]  # bytes
    e.generate(ps, SamplingParams(max_new_tokens=16, ignore_eos=True))
    assert e.stats.num_retractions > 0 and loads  # restored from the host copies
    summary = canary_summary(e)
    assert summary["canary_violations"] == 0
    written = summary["canary_written_by_group"]
    assert set(written) == {"SWA", "C4", "INDEXER", "C128", "C4_STATE", "INDEXER_STATE",
                            "C128_STATE"}  # fmt: skip
    assert written["C4_STATE"] == written["SWA"] > written["C4"] > written["C128"] > 0
    assert_all_memory_free(e)


def test_page_size_must_fit_the_compressors() -> None:
    with pytest.raises(ValueError, match="--page-size 4 is invalid .* multiple of 128"):
        Engine(EngineConfig(model="builtin:tiny-dsv4", page_size=4))
    assert default_page_size("builtin:tiny-dsv4") == 128
    assert default_page_size("builtin:tiny-swa") == EngineConfig.field_default("page_size")


@pytest.mark.parametrize(("target", "tag"), [
    ("swa", "TAIL_K_SWA"), ("c4", "TAIL_K_C4"), ("c128", "TAIL_K_C128"),
    ("indexer", "TAIL_K_INDEXER"), ("c4_ring", "TAIL_K_C4_STATE"),
    ("c128_ring", "TAIL_K_C128_STATE"), ("indexer_ring", "TAIL_K_INDEXER_STATE"),
])  # fmt: skip
def test_canary_reports_a_row_corrupted_in_the_pool(ckpt: Path, target: str, tag: str) -> None:
    """A row of a running request corrupted in place in the DSV4 pool's memory (every layer
    of its sub-pool, no perturb module) is reported by the next forward's TAIL under its
    group's tag as a real-KV mismatch; before the corruption the run is silent."""
    e = engine(ckpt, canary=CanaryConfig(mode="log", real_data="all"))
    prompt = prompts((301,), seed=5)[0]  # live tails: C4 rows 296..300, C128 rows 256..300
    _prefill(e, prompt)
    canary = e.canary
    assert canary is not None and not canary.violations
    pool = e.runner.token_to_kv_pool
    assert isinstance(pool, DSV4KVPool)
    layers = {r: [i for i, x in enumerate(pool.compression_ratios) if x == r] for r in (0, 4, 128)}
    full, swa = _running_slots(e, {"c128": 255, "c128_ring": 280}.get(target, 298))
    if target == "swa":
        for buf in pool.swa_kv_pool.buffers:
            buf[swa] += 1.0
    elif target in ("c4", "c128", "indexer"):
        ratio = 128 if target == "c128" else 4
        for layer in layers[ratio]:
            buf = pool.get_indexer_buffer(layer) if target == "indexer" else pool.get_compressed_buffer(layer)
            buf[full // ratio] += 1.0
    else:
        for layer in layers[128 if target == "c128_ring" else 4]:
            ring = pool.get_indexer_state_buffer(layer) if target == "indexer_ring" else pool.get_state_buffer(layer)
            ring[pool.state_loc(layer, torch.tensor(swa))] += 1.0
    e.step()
    canary.flush()
    rows = [r for r in canary.violations if r.launch_tag == tag]
    assert rows and all("verify_real_kv_hash" in r.fail_reasons for r in rows), canary.violations
    assert {r.launch_tag for r in canary.violations} == {tag}
