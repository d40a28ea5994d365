"""CPU decode attention straight from the paged K/V (ops/cpu/attention.py): the same
results as the torch path (gather + masked SDPA) on random pools, and the engine's decode
through it (eager and graph-runner buckets with padding rows, full and sliding layers)
gives the torch path's greedy tokens and near-identical logits."""

from __future__ import annotations

import math
from collections.abc import Callable

import numba
import numpy as np
import pytest
import torch
from device_mix import DeviceMixChecker
from engine_utils import make_prompts, tiny_engine

from kvcanary import SamplingParams
from kvcanary.ops.cpu import attention as attention_cpu


@pytest.fixture(autouse=True)
def _eager_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are of the eager decode forward's calls (a layer's rope_forward,
    decode_layer, the kernels under them), which the compiled decode forward
    (ops/cpu/decode.py, tests/engine/test_decode_cpu.py) runs without them."""
    monkeypatch.setenv("KVCANARY_CPU_DECODE", "eager")


def _reference(q, k_buf, v_buf, slots, num_keys, scale):  # type: ignore[no-untyped-def]
    """Gather + masked SDPA, one request and KV head at a time (rows without keys see
    slot 0, as the backend's masks make them)."""
    bs, heads, dim = q.shape
    kv_heads = k_buf.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q)
    for b in range(bs):
        n = max(int(num_keys[b]), 1)
        rows = slots[b, :n]
        for h in range(kv_heads):
            qh = q[b, h * group : (h + 1) * group]  # [group, dim]
            keys, values = k_buf[rows, h], v_buf[rows, h]  # [n, dim]
            probs = torch.softmax((qh @ keys.T) * scale, dim=-1)
            out[b, h * group : (h + 1) * group] = probs @ values
    return out


# dims: whole 8-float vectors for the vector kernels (16: two 8-float passes; 40: 32 + 8); 12
# (not whole vectors) and a K/V buffer whose rows are not of unit stride for the loops.
@pytest.mark.parametrize(
    "heads,kv_heads,dim,strided",
    [(4, 4, 16, False), (4, 2, 32, False), (16, 4, 64, False), (8, 2, 40, False),
     (4, 2, 12, False), (4, 2, 32, True)],
)  # fmt: skip
@pytest.mark.parametrize("bs,max_keys", [(1, 7), (5, 40), (24, 300)])
def test_kernel_matches_gathered_attention(
    monkeypatch: pytest.MonkeyPatch, heads, kv_heads, dim, strided, bs, max_keys
) -> None:
    gen = torch.Generator().manual_seed(bs * 1000 + max_keys + heads + dim)
    num_slots = 4 * bs * max_keys + 1
    k_buf = torch.randn(num_slots, kv_heads, dim, generator=gen)
    v_buf = torch.randn(num_slots, kv_heads, dim, generator=gen)
    if strided:  # every other float of wider rows
        k_buf = torch.randn(num_slots, kv_heads, 2 * dim, generator=gen)[:, :, ::2]
        v_buf = torch.randn(num_slots, kv_heads, 2 * dim, generator=gen)[:, :, ::2]
    slots = torch.stack([torch.randperm(num_slots, generator=gen)[:max_keys] for _ in range(bs)])
    num_keys = torch.randint(1, max_keys + 1, (bs,), generator=gen)
    num_keys[0] = max_keys
    if bs > 1:
        num_keys[-1] = 0  # a graph padding row: no key, reads slot 0
        slots[-1] = 0
    # q as the model hands it: a strided view of a wider projection.
    q = torch.randn(bs, heads + kv_heads, dim, generator=gen)[:, :heads]
    scale = 1 / math.sqrt(dim)
    want = _reference(q, k_buf, v_buf, slots, num_keys, scale)
    for parallel_min in (1 << 62, 1):  # the one-thread kernel, then the prange kernel
        monkeypatch.setattr(attention_cpu, "PARALLEL_MIN_WORK", parallel_min)
        got = attention_cpu.decode_attention(q, k_buf, v_buf, slots, num_keys, scale)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # The view read in place: the very bits of a contiguous copy's.
        dense = attention_cpu.decode_attention(q.contiguous(), k_buf, v_buf, slots, num_keys, scale)
        assert torch.equal(got, dense)


@numba.njit(cache=False)
def _exp_all(x):  # type: ignore[no-untyped-def]
    out = np.empty_like(x)
    for j in range(x.shape[0]):
        out[j] = attention_cpu._exp_one(x[j])
    return out


def test_softmax_exp_within_a_few_ulps() -> None:
    """The kernels' exp of shifted scores: within 5 float32 ulps of the exact value down to
    -87, exactly 1 for the peak's score, and no more than e^-87 below (never negative)."""
    x = np.concatenate([np.linspace(-120, 0, 200_001), [0.0, -1e-30, -87.0, -87.5]]).astype(np.float32)
    got = _exp_all(x)
    exact = np.exp(x.astype(np.float64))
    live = x >= -87
    assert (np.abs(got[live] - exact[live]) <= 5 * 2.0**-23 * exact[live]).all()
    assert got[x == 0].tolist() == [1.0, 1.0]
    assert ((got[~live] >= 0) & (got[~live] <= math.exp(-87) * 1.000001)).all()


def _contiguous_tables(gen: torch.Generator, bs: int, kv_heads: int, dim: int, keys: int,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Random K / V buffers of ``bs * keys`` slots (and slot 0), each request's ``keys``
    slots in a row from 1 on: (k_buf, v_buf, slots [bs, keys], num_keys [bs])."""
    k_buf = torch.randn(bs * keys + 1, kv_heads, dim, generator=gen)
    v_buf = torch.randn(bs * keys + 1, kv_heads, dim, generator=gen)
    slots = torch.arange(1, bs * keys + 1).view(bs, keys)
    return k_buf, v_buf, slots, torch.full((bs,), keys)


def test_kernel_matches_attention_with_peaked_scores() -> None:
    """Scores hundreds apart (a query aligned with one key): the other weights underflow in
    both, the kernel's result is still SDPA's."""
    gen = torch.Generator().manual_seed(7)
    bs, heads, kv_heads, dim, keys = 3, 4, 2, 32, 50
    k_buf, v_buf, slots, num_keys = _contiguous_tables(gen, bs, kv_heads, dim, keys)
    q = 60 * torch.randn(bs, heads, dim, generator=gen)
    want = _reference(q, k_buf, v_buf, slots, num_keys, 1 / math.sqrt(dim))
    got = attention_cpu.decode_attention(q, k_buf, v_buf, slots, num_keys, 1 / math.sqrt(dim))
    # Scores of a few hundred carry float32 rounding of ~3e-5 (half an ulp at 256-512), which
    # the softmax turns into weight errors of that relative size; the kernel's fast-math sums
    # run in an order set by the CPU's vector code: within 1e-5 on a Zen 4 machine, 1.9e-5
    # absolute / 1.4e-4 relative on an Emerald Rapids one (session 26).
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("kernel", ["decode", "extend"])
def test_nan_in_the_cache_gives_nan_where_sdpa_does(where: str, kernel: str) -> None:
    """A NaN in one K or V row (a corrupted cache): the heads that read it come out NaN, as
    the gathered SDPA's do, and the rest are still SDPA's; nothing raises (numba's default
    error model raised ZeroDivisionError from the softmax's sum)."""
    gen = torch.Generator().manual_seed(11)
    bs, heads, kv_heads, dim, keys = 3, 4, 2, 32, 20
    k_buf, v_buf, slots, num_keys = _contiguous_tables(gen, bs, kv_heads, dim, keys)
    (k_buf if where == "k" else v_buf)[slots[1, 4], 1, 7] = float("nan")  # request 1, KV head 1
    scale = 1 / math.sqrt(dim)
    q = torch.randn(bs, heads, dim, generator=gen)
    want = _reference(q, k_buf, v_buf, slots, num_keys, scale)
    if kernel == "decode":
        got = attention_cpu.decode_attention(q, k_buf, v_buf, slots, num_keys, scale)
    else:  # each request's last query, which sees every key
        got = attention_cpu.extend_attention(
            q, k_buf, v_buf, slots.numpy(), num_keys.numpy(), np.arange(bs), np.ones(bs, dtype=np.int64),
            np.full(bs, keys - 1), 0, scale,
        )  # fmt: skip
    nan_heads = torch.isnan(want).any(dim=2)
    assert nan_heads.sum() == heads // kv_heads and bool(nan_heads[1, 2:].all())  # the reference's
    assert torch.equal(torch.isnan(got).any(dim=2), nan_heads)
    torch.testing.assert_close(got[~nan_heads], want[~nan_heads], rtol=1e-5, atol=1e-5)


def test_applies_only_to_cpu_float32() -> None:
    q, kv = torch.zeros(2, 4, 8), torch.zeros(10, 2, 8)
    assert attention_cpu.applies(q, kv, kv)
    assert not attention_cpu.applies(q.bfloat16(), kv.bfloat16(), kv.bfloat16())
    assert not attention_cpu.applies(q, kv.half(), kv.half())
    assert not attention_cpu.applies(q, torch.zeros(10, 16), torch.zeros(10, 16))  # MLA-like


def _generate(monkeypatch: pytest.MonkeyPatch, use_kernel: bool, counted: tuple[str, ...],  # type: ignore[no-untyped-def]
              prompts: list[list[int]], max_new_tokens: int, **overrides):  # fmt: skip
    """``prompts`` through a tiny engine, the CPU kernels on or (``use_kernel`` False) the
    torch path; (outputs with logprobs, calls of the ``counted`` attention_cpu functions that
    did the work, the engine)."""
    calls = {"n": 0}

    def counting(real):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            out = real(*args, **kwargs)
            calls["n"] += out is not None and out is not False
            return out

        return call

    monkeypatch.setenv("KVCANARY_CPU_DECODE", "eager")  # (again: undone below)
    for name in counted:
        monkeypatch.setattr(attention_cpu, name, counting(getattr(attention_cpu, name)))
    if not use_kernel:  # the torch path: no kernel
        monkeypatch.setattr(attention_cpu, "applies", lambda *a: False)
        monkeypatch.setattr(attention_cpu, "decode_layer", lambda *a: False)
    engine = tiny_engine(**overrides)
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, logprobs=0)
    outs = engine.generate(prompts, params)
    monkeypatch.undo()
    return outs, calls["n"], engine


def _decode(monkeypatch: pytest.MonkeyPatch, use_kernel: bool, **overrides):  # type: ignore[no-untyped-def]
    # The kernel runs fused with rope and the store (decode_layer) or alone.
    prompts = make_prompts(11, 3, 70, seed=5)  # past the 32-token window on sliding layers
    return _generate(monkeypatch, use_kernel, ("decode_attention", "decode_layer"), prompts, 20,
                     **overrides)  # fmt: skip


def _assert_same_generation(got, ref, num_tokens: int) -> None:  # type: ignore[no-untyped-def]
    """The same tokens, and log-probabilities within 1e-4, ``num_tokens`` per request."""
    assert [o.output_ids for o in got] == [o.output_ids for o in ref]
    for g, r in zip(got, ref, strict=True):
        got_lp = torch.tensor([t.logprob for t in g.logprobs or []])
        ref_lp = torch.tensor([t.logprob for t in r.logprobs or []])
        assert got_lp.numel() == num_tokens
        torch.testing.assert_close(got_lp, ref_lp, rtol=0, atol=1e-4)


@pytest.mark.parametrize("model", ["builtin:tiny-swa", "builtin:tiny-mha"])
@pytest.mark.parametrize("graphs", [(), (1, 2, 4, 8, 16)])
def test_engine_decode_equals_torch_path(
    monkeypatch: pytest.MonkeyPatch, model: str, graphs
) -> None:
    ref, ref_calls, _ = _decode(monkeypatch, False, model=model, graph_batch_sizes=graphs)
    got, calls, engine = _decode(monkeypatch, True, model=model, graph_batch_sizes=graphs)
    assert ref_calls == 0 and calls > 0  # the kernel ran, and only where enabled
    if graphs:
        assert engine.stats.padded_rows > 0  # padding rows went through the kernel too
    _assert_same_generation(got, ref, 20)


@pytest.mark.parametrize("model", ["builtin:tiny-swa", "builtin:tiny-mha"])
@pytest.mark.parametrize("chunk", [4096, 24])
def test_engine_extend_equals_torch_path(monkeypatch: pytest.MonkeyPatch, model: str, chunk: int) -> None:
    """Prefills through attention_cpu.extend_attention (whole prompts, or chunks of 24 tokens:
    queries whose keys start in earlier chunks and, on sliding layers, past the window) give
    the torch path's tokens and log-probabilities (the first token's comes from the prefill)."""
    prompts = make_prompts(7, 20, 90, seed=11)
    settings = dict(model=model, chunked_prefill_size=chunk, enable_prefix_cache=False)
    ref, ref_calls, _ = _generate(monkeypatch, False, ("extend_attention",), prompts, 6, **settings)
    got, calls, _ = _generate(monkeypatch, True, ("extend_attention",), prompts, 6, **settings)
    assert ref_calls == 0 and calls > 0  # the kernel ran, and only where enabled
    _assert_same_generation(got, ref, 6)


@pytest.mark.parametrize("bad", [-1, 10])
def test_slot_outside_the_buffer_raises_before_reading(bad: int) -> None:
    q, kv = torch.zeros(2, 4, 8), torch.zeros(10, 2, 8)
    slots = torch.tensor([[1, 2, 3], [4, bad, 0]])
    want = rf"request row 1 reads 2 keys, slots \[4, {bad}\]; allowed slots in \[0, 10\), at most 3 keys"
    with pytest.raises(IndexError, match=want):
        attention_cpu.decode_attention(q, kv, kv, slots, torch.tensor([3, 2]), 1.0)
    with pytest.raises(IndexError, match=r"request row 0 reads 4 keys"):  # past the table's width
        attention_cpu.decode_attention(q, kv, kv, slots[:, :3], torch.tensor([4, 1]), 1.0)
    # A key past the request's count is never read, so it is not checked.
    attention_cpu.decode_attention(q, kv, kv, slots, torch.tensor([3, 1]), 1.0)


# ----------------------------------------------------------------- decode key tables


def _random_decode_batch(gen: torch.Generator, bs: int, width: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """A slot table, the rows of ``bs`` requests (the last a graph padding row: table row
    0, one key) and their lengths."""
    table = torch.randint(1, 10_000, (bs + 3, width), generator=gen, dtype=torch.int64).to(dtype)
    rows = torch.randperm(bs + 2, generator=gen)[:bs] + 1
    seq = torch.randint(1, width + 1, (bs,), generator=gen)
    rows[-1], seq[-1] = 0, 1
    return table, rows, seq


@pytest.mark.parametrize("window", [0, 1, 7, 32])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("bs", [1, 5, 33])
def test_decode_tables_equal_key_view(window: int, dtype: torch.dtype, bs: int) -> None:
    from types import SimpleNamespace

    from kvcanary.engine.attention import QueryLayout, key_view

    gen = torch.Generator().manual_seed(bs * 100 + window)
    for width in (1, 40, 130):
        table, rows, seq = _random_decode_batch(gen, bs, width, dtype)
        pre = seq - 1
        fb = SimpleNamespace(extend_seq_lens_cpu=[1] * bs, prefix_lens_cpu=pre.tolist(),
                             seq_lens_cpu=seq.tolist(), batch_size=bs, num_tokens=bs,
                             input_ids=torch.zeros(bs, dtype=torch.int64))  # fmt: skip
        layout = QueryLayout.of(fb)  # type: ignore[arg-type]
        loc = torch.randint(1, 10_000, (bs,), generator=gen)
        slots, mask, sliding = attention_cpu.decode_tables(
            table.numpy(), rows.numpy(), pre.numpy(), seq.numpy(), window, loc.numpy()
        )
        want = key_view(table, rows, layout, torch.zeros(bs, dtype=torch.int64), None, torch.device("cpu"))
        assert torch.equal(torch.from_numpy(slots), want[0])
        assert torch.equal(torch.from_numpy(mask), want[1])
        assert torch.equal(seq, want[2])
        if window == 0:
            assert sliding is None
            continue
        assert sliding is not None
        both, sw_mask, sw_keys = sliding
        start = (layout.pre - window + 1).clamp(min=0)
        want = key_view(table, rows, layout, start, window, torch.device("cpu"))
        assert torch.equal(torch.from_numpy(both[:bs]), loc)  # this forward's writes first
        assert torch.equal(torch.from_numpy(both[bs:]).view(bs, -1), want[0])
        assert torch.equal(torch.from_numpy(sw_mask), want[1])
        assert torch.equal(torch.from_numpy(sw_keys), want[2])


@pytest.mark.parametrize("case", ["row", "negative-row", "length"])
def test_decode_tables_refuse_a_batch_outside_the_table(case: str) -> None:
    table = torch.arange(40, dtype=torch.int32).view(4, 10).numpy()
    rows, seq = torch.tensor([1, 2]), torch.tensor([3, 5])
    if case == "row":
        rows[1] = 4
    elif case == "negative-row":
        rows[1] = -1
    else:
        seq[1] = 11
    want = rf"request row {int(rows[1])} with {int(seq[1])} keys; allowed rows in \[0, 4\), at most 10 keys"
    with pytest.raises(IndexError, match=want):
        attention_cpu.decode_tables(table, rows.numpy(), (seq - 1).numpy(), seq.numpy(), 4,
                                    torch.tensor([7, 8]).numpy())  # fmt: skip


def test_fill_tables_pads_like_the_torch_copy() -> None:
    from kvcanary.engine.attention import StaticKeyBuffers, _KeyView

    gen = torch.Generator().manual_seed(3)
    table, rows, seq = _random_decode_batch(gen, 6, 20, torch.int64)
    slots, mask, _ = attention_cpu.decode_tables(table.numpy(), rows.numpy(), (seq - 1).numpy(),
                                                 seq.numpy(), 0, rows.numpy())  # fmt: skip
    loc = torch.arange(6) + 100
    host = (slots, mask, loc.numpy(), seq.numpy())
    views = [_KeyView(*(torch.from_numpy(a) for a in host)) for _ in range(2)]
    views[0].host = host  # the compiled copy; the other: torch's
    width = int(seq.max()) + 5
    got, want = (StaticKeyBuffers(8, 64, torch.device("cpu")) for _ in range(2))
    for buf in (got, want):  # stale contents the copy must overwrite
        buf.slots.fill_(-7)
        buf.mask.fill_(True)
    out = [got.fill(views[0], width), want.fill(views[1], width)]
    for a, b in zip((out[0].slots, out[0].mask, out[0].write_loc, out[0].num_keys),
                    (out[1].slots, out[1].mask, out[1].write_loc, out[1].num_keys), strict=True):  # fmt: skip
        assert torch.equal(a, b)
    assert out[0].slots.shape == (6, width) and not out[0].mask[:, :, int(seq.max()) :].any()
    assert torch.equal(got.slots, want.slots)  # past the filled rows: untouched by both
    # Tables wider than the buffers: refused, nothing copied.
    before = got.slots.clone()
    assert not attention_cpu.fill_tables(*host, *got._host, int(seq.max()) - 1)  # type: ignore[misc]
    assert not attention_cpu.fill_tables(*host, *got._host, 11)  # type: ignore[misc]  # 6 x 11 > 64
    assert torch.equal(got.slots, before)


@pytest.mark.parametrize("graphs", [(), (1, 2, 4, 8, 16)])
def test_engine_decode_tables_equal_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, graphs: tuple[int, ...]
) -> None:
    """Every decode forward of a tiny-swa engine: the compiled tables (SWA-translated slots
    and write locations included) are the torch path's on the same batch."""
    from kvcanary.engine.attention import PagedAttentionBackend

    real = PagedAttentionBackend.init_forward_metadata
    fast = PagedAttentionBackend._init_decode_cpu
    checked = {"n": 0}

    def both_ways(self, fb):  # type: ignore[no-untyped-def]
        real(self, fb)
        if not fb.is_decode:
            return
        got = (self._full, self._sliding, self._q_index, self._q_valid, self._dense_q)
        monkeypatch.setattr(PagedAttentionBackend, "_init_decode_cpu", lambda *_: False)
        real(self, fb)
        monkeypatch.setattr(PagedAttentionBackend, "_init_decode_cpu", fast)
        want = (self._full, self._sliding, self._q_index, self._q_valid, self._dense_q)
        for g, w in zip(got[:2], want[:2], strict=True):
            for name in ("slots", "write_loc", "num_keys"):
                assert torch.equal(getattr(g, name), getattr(w, name)), name
            assert torch.equal(g.visible(), w.visible())  # (the torch path's made on first use)
        assert got[1] is not None and got[1].host is not None
        assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3]) and got[4] is want[4]
        checked["n"] += 1

    monkeypatch.setattr(PagedAttentionBackend, "init_forward_metadata", both_ways)
    engine = tiny_engine(model="builtin:tiny-swa", graph_batch_sizes=graphs)
    engine.generate(make_prompts(5, 3, 70, seed=2), SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert checked["n"] >= 11


def test_graph_buckets_rebuild_the_gqa_mask_each_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path through the graph runner's static tables: a short request decoding
    beside one past the window keeps the sliding table's width (the window) while its own
    visible keys grow every step; each step's GQA-folded mask is that step's (the same
    logprobs as eager decode)."""
    monkeypatch.setattr(attention_cpu, "applies", lambda *a: False)  # SDPA with masks
    prompts = [make_prompts(1, 50, 50, seed=7)[0], make_prompts(1, 3, 3, seed=8)[0]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=0)
    outs = [tiny_engine(model="builtin:tiny-swa", graph_batch_sizes=graphs).generate(prompts, params)
            for graphs in ((), (1, 2, 4))]  # fmt: skip
    for eager, graphed in zip(*outs, strict=True):
        assert graphed.output_ids == eager.output_ids
        lp = [torch.tensor([t.logprob for t in o.logprobs or []]) for o in (graphed, eager)]
        assert lp[0].numel() == 12
        torch.testing.assert_close(lp[0], lp[1], rtol=0, atol=1e-5)


def test_extend_masks_are_made_only_when_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU prefill whose attention the compiled extend kernel takes never builds the key
    masks (they cost ~15 ms at tiny-swa's batch-64 prefill); made on first use they are
    :func:`key_view`'s, and where the torch path reads them (``attention_cpu.applies``
    False) they are made and the tokens are the same."""
    from kvcanary.engine.attention import PagedAttentionBackend, QueryLayout, key_view

    real = PagedAttentionBackend.init_forward_metadata
    seen: list[tuple[object, ...]] = []

    def record(self, fb):  # type: ignore[no-untyped-def]
        real(self, fb)
        if not fb.is_decode:
            layout = QueryLayout.of(fb)
            rows = fb.req_pool_indices.to(torch.int64)
            w = self.sliding_window
            starts = (torch.zeros(fb.batch_size, dtype=torch.int64), (layout.pre - w + 1).clamp(min=0))
            seen.append((self._full, self._sliding, [
                key_view(self.req_to_token_pool.req_to_token, rows, layout, st, win, torch.device("cpu"))[1]
                for st, win in zip(starts, (None, w), strict=True)]))  # fmt: skip

    monkeypatch.setattr(PagedAttentionBackend, "init_forward_metadata", record)
    prompts = make_prompts(6, 40, 90, seed=5)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    compiled = [o.output_ids for o in tiny_engine(model="builtin:tiny-swa").generate(prompts, params)]
    assert seen
    for full, sliding, want in seen:
        for view, mask in zip((full, sliding), want, strict=True):
            assert view.first_col is not None and view.mask is None  # the kernel took it: none made
            assert torch.equal(view.visible(), mask)
    seen.clear()
    monkeypatch.setattr(attention_cpu, "applies", lambda *a: False)  # SDPA, which reads them
    eager = [o.output_ids for o in tiny_engine(model="builtin:tiny-swa").generate(prompts, params)]
    assert seen and all(v.mask is not None for full, sliding, _ in seen for v in (full, sliding))
    assert eager == compiled


def test_additive_gqa_mask_gives_the_bool_masks_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend hands SDPA the additive mask (0 / -inf, built once per forward) that SDPA
    would make of the bool one on every call: its values are that conversion's, and the
    engine's tokens and logprobs (prefills through SDPA; decode through it too here) are bit
    for bit those of the bool mask."""
    from kvcanary.engine.attention import _KeyView

    monkeypatch.setattr(attention_cpu, "applies", lambda *a: False)  # SDPA with masks
    view = _KeyView(torch.zeros(2, 5, dtype=torch.int64), torch.rand(2, 3, 5) > 0.4,
                    torch.zeros(6, dtype=torch.int64), torch.full((2,), 5))  # fmt: skip
    bool_mask = view.mask[:, None, None].expand(2, 1, 2, 3, 5).reshape(2, 1, 6, 5)
    additive = view.grouped_mask(2, torch.float32)
    assert additive.dtype == torch.float32 and torch.equal(additive == 0, bool_mask)
    assert bool(torch.isneginf(additive[~bool_mask]).all())
    assert view.grouped_mask(2, torch.float32) is additive  # once per forward
    # Off the host (a stand-in device here) a decode's mask stays a view of the key view's:
    # a CUDA graph captured after warm-up runs must read the static buffer each replay
    # refills, not a mask a warm-up run materialised (seen on an H100: wrong outputs).
    with DeviceMixChecker():  # tensors made on "cpu:0" read as a device's
        dev = _KeyView(torch.zeros(3, 5, dtype=torch.int64, device="cpu:0"),
                       torch.rand(3, 1, 5, device="cpu:0") > 0.4,
                       torch.zeros(3, dtype=torch.int64, device="cpu:0"), torch.full((3,), 5))  # fmt: skip
        folded = dev.grouped_mask(2, torch.float32)
        assert folded.dtype == torch.bool and folded.shape == (3, 1, 2, 5)
        dev.mask.fill_(True)  # the next step's tables, copied into the same buffer
        assert bool(folded.all())

    prompts = make_prompts(4, 20, 90, seed=11)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=0)
    outs = [tiny_engine(model="builtin:tiny-swa").generate(prompts, params)]
    with monkeypatch.context() as m:  # the bool mask, as SDPA got it before
        m.setattr(_KeyView, "grouped_mask", lambda self, group, dtype: self.visible()[:, None, None]
                  .expand(self.mask.shape[0], 1, group, *self.mask.shape[1:])
                  .reshape(self.mask.shape[0], 1, group * self.mask.shape[1], self.mask.shape[2]))  # fmt: skip
        outs.append(tiny_engine(model="builtin:tiny-swa").generate(prompts, params))
    for new, old in zip(*outs, strict=True):
        assert new.output_ids == old.output_ids
        lp = [torch.tensor([t.logprob for t in o.logprobs or []]) for o in (new, old)]
        assert lp[0].numel() == 6 and torch.equal(lp[0], lp[1])


@pytest.mark.parametrize("norm", ["none", "weight", "norm+weight"])
@pytest.mark.parametrize("heads,kv_heads,dim,bs,max_keys", [
    (4, 2, 32, 1, 9), (4, 2, 32, 16, 120), (16, 8, 128, 5, 40), (8, 8, 16, 33, 70),
])  # fmt: skip
def test_decode_layer_is_rope_store_and_attention(
    monkeypatch: pytest.MonkeyPatch, norm, heads, kv_heads, dim, bs, max_keys
) -> None:
    """decode_layer == rope_cpu.rope, index_copy_ of k / v into the buffers, decode_attention:
    the same output bits and the same buffers after (one thread and split), from the
    projection as the GEMM leaves it (the three calls take strided views of it)."""
    from kvcanary.model.rope import RotaryEmbedding
    from kvcanary.ops.cpu import rmsnorm as norm_cpu
    from kvcanary.ops.cpu import rope as rope_cpu

    gen = torch.Generator().manual_seed(bs * 7 + heads + dim + len(norm))
    num_slots = 3 * bs * max_keys + 2
    k0 = torch.randn(num_slots, kv_heads, dim, generator=gen)
    v0 = torch.randn(num_slots, kv_heads, dim, generator=gen)
    perm = torch.randperm(num_slots - 1, generator=gen) + 1
    loc = perm[:bs]  # this step's new slots, each the last key of its request
    slots = perm[bs : bs + bs * max_keys].view(bs, max_keys).clone()
    num_keys = torch.randint(1, max_keys + 1, (bs,), generator=gen)
    slots[torch.arange(bs), num_keys - 1] = loc
    qkv = torch.randn(bs, (heads + 2 * kv_heads) * dim, generator=gen)
    qk = qkv[:, : (heads + kv_heads) * dim].view(bs, heads + kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(bs, kv_heads, dim)
    cos, sin = RotaryEmbedding(dim, 10000.0, None, 4096, None, torch.float32).cos_sin(
        torch.randint(0, 4000, (bs,), generator=gen))  # fmt: skip
    weight = None if norm == "none" else torch.rand(heads + kv_heads, dim, generator=gen) + 0.5
    eps = 1e-6 if norm == "norm+weight" and norm_cpu.lanes() else None
    scale = 1 / math.sqrt(dim)
    rot = rope_cpu.rope(qk, cos, sin, weight, eps)
    k_want, v_want = k0.clone(), v0.clone()
    k_want.index_copy_(0, loc, rot[:, heads:])
    v_want.index_copy_(0, loc, v)
    want = attention_cpu.decode_attention(rot[:, :heads], k_want, v_want, slots, num_keys, scale)
    cos_np, sin_np = rope_cpu.tables(cos, sin, bs, dim)
    for parallel_min in (1 << 62, 1):
        monkeypatch.setattr(attention_cpu, "PARALLEL_MIN_WORK", parallel_min)
        k_buf, v_buf = k0.clone(), v0.clone()
        got = torch.full((bs, heads, dim), float("nan"))
        assert attention_cpu.decode_layer(
            qkv.numpy().reshape(bs, -1, dim), heads, cos_np, sin_np,
            None if weight is None else weight.numpy(), eps, k_buf.numpy(), v_buf.numpy(),
            loc.numpy(), slots.numpy(), num_keys.numpy(), scale, got.numpy(),
        )  # fmt: skip
        assert torch.equal(got, want)
        assert torch.equal(k_buf, k_want) and torch.equal(v_buf, v_want)


@pytest.mark.parametrize("case", ["loc", "slot", "keys"])
def test_decode_layer_refuses_what_it_cannot_read(case: str) -> None:
    """A write slot or a key outside the buffers, or more keys than the table holds: False,
    nothing written (the caller's unfused calls raise their own errors)."""
    bs, heads, kv_heads, dim = 3, 4, 2, 8
    k_buf, v_buf = torch.randn(20, kv_heads, dim), torch.randn(20, kv_heads, dim)
    k0, v0 = k_buf.clone(), v_buf.clone()
    qkv = torch.randn(bs, heads + 2 * kv_heads, dim)
    loc = torch.tensor([3, 4, 5])
    slots = torch.tensor([[1, 3], [2, 4], [6, 5]])
    num_keys = torch.tensor([2, 2, 2])
    if case == "loc":
        loc[1] = 20
    elif case == "slot":
        slots[2, 0] = -1
    else:
        num_keys[0] = 3
    cos, sin = np.ones((bs, dim), np.float32), np.zeros((bs, dim), np.float32)
    out = torch.zeros(bs, heads, dim)
    assert not attention_cpu.decode_layer(qkv.numpy(), heads, cos, sin, None, None, k_buf.numpy(),
                                          v_buf.numpy(), loc.numpy(), slots.numpy(),
                                          num_keys.numpy(), 0.5, out.numpy())  # fmt: skip
    assert torch.equal(k_buf, k0) and torch.equal(v_buf, v0) and not out.any()


@pytest.mark.parametrize("model", ["builtin:tiny-swa", "builtin:tiny-mha", "builtin:tiny-swa-all"])
def test_engine_fused_decode_layer_equals_unfused(monkeypatch: pytest.MonkeyPatch, model: str) -> None:
    """The engine's decode with rope, the K/V store and attention fused
    (PagedAttentionBackend.rope_forward) gives the unfused calls' tokens and logprobs bit for
    bit, and the same KV cache; it runs on every decode layer, and not where a wrapper other
    than the store check's wraps set_kv_buffer (it must see the store)."""
    from kvcanary.engine.attention import PagedAttentionBackend

    fused = {"n": 0, "refused": 0}
    real = PagedAttentionBackend.rope_forward

    def counting(self, *args):  # type: ignore[no-untyped-def]
        out = real(self, *args)
        fused["n" if out is not None else "refused"] += 1
        return out

    def run(fuse: bool):  # type: ignore[no-untyped-def]
        monkeypatch.setattr(PagedAttentionBackend, "rope_forward", counting if fuse else lambda *a: None)
        engine = tiny_engine(model=model)
        prompts = make_prompts(11, 3, 70, seed=5)
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=0))
        return outs, engine

    ref, ref_engine = run(False)
    got, engine = run(True)
    layers = len(engine.runner.model.layers)
    assert fused["n"] == layers * engine.stats.num_decode_forwards > 0
    assert [o.output_ids for o in got] == [o.output_ids for o in ref]
    for g, r in zip(got, ref, strict=True):
        assert [t.logprob for t in g.logprobs or []] == [t.logprob for t in r.logprobs or []]

    def subs(engine):  # type: ignore[no-untyped-def]
        pool = engine.runner.token_to_kv_pool
        return [pool.full_kv_pool, pool.swa_kv_pool] if hasattr(pool, "swa_kv_pool") else [pool]

    for sub, ref_sub in zip(subs(engine), subs(ref_engine), strict=True):
        for a, b in zip(sub.all_buffers(), ref_sub.all_buffers(), strict=True):
            assert torch.equal(a, b)
    # A wrapped store (as a lost-store fault wraps it): the unfused calls, so the wrapper
    # sees every decode layer's store; the method put back: fused again.
    stores = {"n": 0}
    originals = []
    for sub in subs(engine):
        original = sub.set_kv_buffer
        originals.append((sub, original))

        def seen(*args, _original=original):  # type: ignore[no-untyped-def]
            stores["n"] += 1
            return _original(*args)

        sub.set_kv_buffer = seen
    before = dict(fused)
    decode_forwards = engine.stats.num_decode_forwards
    engine.generate(make_prompts(2, 3, 20, seed=6), SamplingParams(max_new_tokens=4, ignore_eos=True))
    decodes = engine.stats.num_decode_forwards - decode_forwards
    assert fused["n"] == before["n"] and fused["refused"] >= before["refused"] + layers * decodes
    assert stores["n"] >= layers * (decodes + 1)  # every decode layer's store, and the prefill's
    for sub, original in originals:
        sub.set_kv_buffer = original  # the bound method put back, as a fault's undo does
    engine.generate(make_prompts(2, 3, 20, seed=6), SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert fused["n"] > before["n"]


@pytest.mark.parametrize("real_data", ["partial", "all"])
def test_fused_decode_layer_beside_the_store_check(monkeypatch: pytest.MonkeyPatch, real_data: str) -> None:
    """With the canary's store check on (real-data modes) every decode layer still fuses:
    on the layers it observes the backend hands it what the kernel stored (its watches arm,
    a clean run has no violation, the tokens are the no-canary engine's), and a row the
    kernel stored that changes before TAIL is reported (write_kv_store). A wrapper over the
    check's (as the lost-store fault makes) turns fusion off for its sub-pool's layers."""
    from kvcanary.config import CanaryConfig
    from kvcanary.engine.attention import PagedAttentionBackend

    fused = {"n": 0}
    real = PagedAttentionBackend.rope_forward

    def counting(self, *args):  # type: ignore[no-untyped-def]
        out = real(self, *args)
        fused["n"] += out is not None
        return out

    monkeypatch.setattr(PagedAttentionBackend, "rope_forward", counting)
    prompts = make_prompts(6, 3, 70, seed=7)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    want = [o.output_ids for o in tiny_engine().generate(prompts, params)]
    engine = tiny_engine(canary=CanaryConfig(mode="log", real_data=real_data))
    checker = engine.canary.runtime.store_checker
    assert checker is not None
    pool = engine.runner.token_to_kv_pool
    subs = [pool.full_kv_pool, pool.swa_kv_pool]
    layers = len(engine.runner.model.layers)
    assert 0 < sum(len(checker.targets(sub) or {}) for sub in subs) < layers
    # The fused layers hand their stores over as addresses (observe_rows), every other
    # store (the prefill's) as tensors.
    calls = {"observe": 0, "observe_rows": 0}

    def counted(name: str) -> Callable[..., object]:
        call = getattr(checker, name)

        def counting_call(*args: object) -> object:
            calls[name] += 1
            return call(*args)

        return counting_call

    for name in calls:
        monkeypatch.setattr(checker, name, counted(name))
    fused["n"] = 0
    assert [o.output_ids for o in engine.generate(prompts, params)] == want
    decodes = engine.stats.num_decode_forwards
    assert fused["n"] == decodes * layers
    observed_layers = sum(len(checker.targets(sub) or {}) for sub in subs)
    assert calls["observe_rows"] == decodes * observed_layers
    assert calls["observe"] == engine.stats.num_extend_forwards * len(checker.watches)
    assert all(w.armed for w in checker.watches) and engine.canary.stats()["violations"] == 0

    # An observed layer's stored k row changed after the fused store, before TAIL: reported.
    full_sub = pool.full_kv_pool
    observed = next(iter(checker.targets(full_sub) or {}))
    real_layer = attention_cpu.decode_layer

    def overwritten(qkv, num_heads, cos, sin, weight, eps, k_np, v_np, loc, *rest):  # type: ignore[no-untyped-def]
        done = real_layer(qkv, num_heads, cos, sin, weight, eps, k_np, v_np, loc, *rest)
        if done and k_np.ctypes.data == full_sub.k_buffer[observed].data_ptr() and not hits:
            hits.append(int(loc[0]))
            k_np[loc[0]] += 1.0  # the first token's stored k row
        return done

    hits: list[int] = []
    monkeypatch.setattr(attention_cpu, "decode_layer", overwritten)
    before = len(engine.canary.violations)
    engine.generate(prompts[:3], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert len(hits) == 1
    rows = engine.canary.violations[before:]
    assert rows and rows[0].launch_tag == "TAIL_K_FULL" and rows[0].slot_idx == hits[0]
    assert "write_kv_store" in rows[0].fail_reasons


def _extend_reference(q, k_buf, v_buf, slots, num_keys, starts, ext, first_col, window, scale):  # type: ignore[no-untyped-def]
    """Query by query: softmax over the keys the mask rule lets it see (full: columns up to
    its own; sliding: the last ``window`` of those)."""
    heads = q.shape[1]
    group = heads // k_buf.shape[1]
    out = torch.zeros_like(q)
    for b in range(len(ext)):
        for i in range(int(ext[b])):
            c = int(first_col[b]) + i
            lo = max(c - window + 1, 0) if window else 0
            rows = torch.as_tensor(slots[b, lo : c + 1])
            for hq in range(heads):
                keys, values = k_buf[rows, hq // group], v_buf[rows, hq // group]
                probs = torch.softmax((keys @ q[int(starts[b]) + i, hq]) * scale, dim=-1)
                out[int(starts[b]) + i, hq] = probs @ values
    return out


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 32), (16, 8, 64), (4, 4, 32), (6, 2, 20), (12, 2, 18)])
@pytest.mark.parametrize("window", [0, 5, 32])
def test_extend_kernel_matches_masked_attention(monkeypatch: pytest.MonkeyPatch, heads, kv_heads, dim,
                                                window) -> None:  # fmt: skip
    """Requests with cached prefixes and new tokens of every length (one is a whole prompt,
    one a single token), against softmax over exactly the keys each query may see."""
    gen = torch.Generator().manual_seed(heads + dim + window)
    pre = np.array([0, 7, 40, 3, 90], dtype=np.int64)
    ext = np.array([12, 1, 25, 9, 33], dtype=np.int64)
    seq = pre + ext
    key_start = np.maximum(pre - window + 1, 0) if window else np.zeros_like(pre)
    num_keys = seq - key_start
    width = int(num_keys.max())
    num_slots = 4 * int(seq.sum()) + 1
    k_buf = torch.randn(num_slots, kv_heads, dim, generator=gen)
    v_buf = torch.randn(num_slots, kv_heads, dim, generator=gen)
    slots = np.zeros((len(ext), width), dtype=np.int64)
    for b in range(len(ext)):
        slots[b, : num_keys[b]] = torch.randperm(num_slots - 1, generator=gen)[: num_keys[b]].numpy() + 1
    starts = np.cumsum(ext) - ext
    q = torch.randn(int(ext.sum()), heads + kv_heads, dim, generator=gen)[:, :heads]  # a strided view
    first_col = pre - key_start
    scale = 1 / math.sqrt(dim)
    want = _extend_reference(q, k_buf, v_buf, slots, num_keys, starts, ext, first_col, window, scale)
    for parallel_min in (1 << 62, 1):  # the one-thread kernel, then the prange kernel
        monkeypatch.setattr(attention_cpu, "PARALLEL_MIN_WORK", parallel_min)
        got = attention_cpu.extend_attention(q, k_buf, v_buf, slots, num_keys, starts, ext, first_col,
                                             window, scale)  # fmt: skip
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Three query rows past the requests' (no request covers them): zeros, even where the
    # allocator hands back memory a NaN-filled tensor of that size just held.
    extra = torch.cat((q, torch.randn(3, heads, dim, generator=gen)))
    torch.full((extra.shape[0], heads, dim), float("nan"))  # (freed at once)
    got = attention_cpu.extend_attention(extra, k_buf, v_buf, slots, num_keys, starts, ext, first_col,
                                         window, scale)  # fmt: skip
    torch.testing.assert_close(got[: q.shape[0]], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[q.shape[0] :], torch.zeros(3, heads, dim))


def test_extend_pays_counts_the_scores_each_query_may_see() -> None:
    """extend_pays' closed forms against counting query by query, on random tables."""
    rng = np.random.default_rng(1)
    for _ in range(500):
        bs = int(rng.integers(1, 6))
        ext, first_col = rng.integers(1, 60, bs), rng.integers(0, 80, bs)
        window = int(rng.choice([0, 1, 5, 32, 100]))
        width = int((first_col + ext).max() + rng.integers(0, 50))
        seen = sum(min(c + 1, window) if window else c + 1
                   for f, e in zip(first_col, ext, strict=True) for c in range(f, f + e))  # fmt: skip
        want = bs * int(ext.max()) * width >= attention_cpu.EXTEND_MIN_PADDING * seen
        assert attention_cpu.extend_pays(first_col, ext, window, width) == want
    # One 512-token chunk after 512 cached: SDPA's table is hardly padded on a full layer;
    # a 32-key window sees a sixteenth of it.
    one = np.array([512]), np.array([512])
    assert not attention_cpu.extend_pays(*one, 0, 1024)
    assert attention_cpu.extend_pays(np.array([31]), np.array([512]), 32, 543)


@pytest.mark.parametrize("case", ["slot", "past_keys", "rows"])
def test_extend_kernel_refuses_tables_that_do_not_hold(case: str) -> None:
    k_buf = torch.zeros(16, 1, 8)
    slots = np.array([[1, 2, 3, 4]], dtype=np.int64)
    num_keys, starts, ext, first_col = (np.array([x], dtype=np.int64) for x in (4, 0, 2, 2))
    q = torch.zeros(2, 2, 8)
    if case == "slot":
        slots[0, 3] = 16  # one past the buffer
    elif case == "past_keys":
        first_col[0] = 3  # its second query would sit at column 4 of 4 keys
    else:
        q = torch.zeros(1, 2, 8)  # two new tokens, one query row
    with pytest.raises(IndexError, match="extend attention: request row 0"):
        attention_cpu.extend_attention(q, k_buf, k_buf, slots, num_keys, starts, ext, first_col, 0, 1.0)
