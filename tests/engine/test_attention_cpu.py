"""CPU decode attention straight from the paged K/V (engine/attention_cpu.py): the same
results as the torch path (gather + masked SDPA) on random pools, and the engine's decode
through it (eager and graph-runner buckets with padding rows, full and sliding layers)
gives the torch path's greedy tokens and near-identical logits."""

from __future__ import annotations

import math

import pytest
import torch
from engine_utils import make_prompts, tiny_engine

from kvcanary import SamplingParams
from kvcanary.engine import attention_cpu


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


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 16), (4, 2, 32), (16, 4, 64)])
@pytest.mark.parametrize("bs,max_keys", [(1, 7), (5, 40), (24, 300)])
def test_kernel_matches_gathered_attention(
    monkeypatch: pytest.MonkeyPatch, heads, kv_heads, dim, bs, max_keys
) -> None:
    gen = torch.Generator().manual_seed(bs * 1000 + max_keys + heads + dim)
    num_slots = 4 * bs * max_keys + 1
    k_buf = torch.randn(num_slots, kv_heads, dim, generator=gen)
    v_buf = torch.randn(num_slots, kv_heads, dim, generator=gen)
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


def test_applies_only_to_cpu_float32() -> None:
    q, kv = torch.zeros(2, 4, 8), torch.zeros(10, 2, 8)
    assert attention_cpu.applies(q, kv, kv)
    assert not attention_cpu.applies(q.bfloat16(), kv.bfloat16(), kv.bfloat16())
    assert not attention_cpu.applies(q, kv.half(), kv.half())
    assert not attention_cpu.applies(q, torch.zeros(10, 16), torch.zeros(10, 16))  # MLA-like


def _decode(monkeypatch: pytest.MonkeyPatch, use_kernel: bool, **overrides):  # type: ignore[no-untyped-def]
    calls = {"n": 0}
    real = attention_cpu.decode_attention

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_cpu, "decode_attention", counting)
    if not use_kernel:
        monkeypatch.setattr(attention_cpu, "applies", lambda *a: False)
    engine = tiny_engine(**overrides)
    prompts = make_prompts(11, 3, 70, seed=5)  # past the 32-token window on sliding layers
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=0)
    outs = engine.generate(prompts, params)
    monkeypatch.undo()
    return outs, calls["n"], engine


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
    assert [o.output_ids for o in got] == [o.output_ids for o in ref]
    for g, r in zip(got, ref, strict=True):
        got_lp = torch.tensor([t.logprob for t in g.logprobs or []])
        ref_lp = torch.tensor([t.logprob for t in r.logprobs or []])
        assert got_lp.numel() == 20
        torch.testing.assert_close(got_lp, ref_lp, rtol=0, atol=1e-4)


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
