"""The CPU decode forward in one compiled call (kvcanary.ops.cpu.decode) against the
eager, module-by-module forward: the same greedy tokens, logprobs and KV within float
rounding, its GEMM bit for bit F.linear's, and the eager forward wherever a store must be
seen (the canary's store check, a fault's wrapper) or the path is turned off."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from engine_utils import make_prompts
from torch.nn import functional as F

from kvcanary import Engine, EngineConfig, SamplingParams
from kvcanary.canary.config import CanaryConfig
from kvcanary.engine.attention import PagedAttentionBackend
from kvcanary.memory.mha_pool import MHAKVPool
from kvcanary.ops.cpu import decode as decode_cpu


def _engine(monkeypatch: pytest.MonkeyPatch, mode: str, **overrides: Any) -> Engine:
    monkeypatch.setenv("KVCANARY_CPU_DECODE", mode)
    base: dict[str, Any] = dict(model="builtin:tiny-swa", page_size=4, max_total_tokens=4096,
                                max_context_len=1024)  # fmt: skip
    base.update(overrides)
    return Engine(EngineConfig(**base))


def _count_compiled(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the compiled forwards that ran to the end (the real kernel, wrapped)."""
    real, calls = decode_cpu._forward_nb, []

    def counting(*args: Any) -> Any:
        bad = real(*args)
        calls.append(int(bad))
        return bad

    monkeypatch.setattr(decode_cpu, "_forward_nb", counting)
    return calls


def _kv(engine: Engine) -> list[torch.Tensor]:
    pool = engine.runner.token_to_kv_pool
    subs = [pool.full_kv_pool, pool.swa_kv_pool] if hasattr(pool, "swa_kv_pool") else [pool]
    return [b.clone() for sub in subs for b in (*sub.k_buffer, *sub.v_buffer)]


def _run(engine: Engine, prompts: list[list[int]], n: int = 20) -> list[Any]:
    params = SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=2)
    return engine.generate(prompts, params)


@pytest.mark.parametrize(("model", "graphs"), [
    ("builtin:tiny-swa", ()), ("builtin:tiny-swa", (1, 2, 4, 8, 16)), ("builtin:tiny-mha", ()),
    ("builtin:tiny-swa-all", (4, 16)),
])  # fmt: skip
def test_compiled_decode_matches_the_eager_forward(monkeypatch: pytest.MonkeyPatch, model: str,
                                                   graphs: tuple[int, ...]) -> None:  # fmt: skip
    """Greedy tokens equal, every sampled token's logprob within 1e-4 and every K/V row
    within 1e-4 of the eager forward's (they differ by the SiLU's rounding only), over
    decode batches of several sizes (graph buckets: padding rows too), window eviction
    included (prompts past the window)."""
    prompts = make_prompts(9, 20, 70, seed=3)
    eager = _engine(monkeypatch, "eager", model=model, graph_batch_sizes=graphs)
    want = _run(eager, prompts)
    want_kv = _kv(eager)
    calls = _count_compiled(monkeypatch)
    compiled = _engine(monkeypatch, "compiled", model=model, graph_batch_sizes=graphs)
    got = _run(compiled, prompts)
    assert calls and all(c == -1 for c in calls)  # decode forwards ran compiled, to the end
    assert [o.output_ids for o in got] == [o.output_ids for o in want]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose([t.logprob for t in a.logprobs], [t.logprob for t in b.logprobs],
                                   atol=1e-4)  # fmt: skip
    for a, b in zip(_kv(compiled), want_kv, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    if graphs:
        assert compiled.stats.padded_rows > 0  # padding rows went through it too


def test_a_token_outside_the_vocabulary_raises_as_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode token id past the embedding is not read: the eager forward runs and raises
    the embedding's error."""
    engine = _engine(monkeypatch, "compiled")
    calls = _count_compiled(monkeypatch)
    rid = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine.step()  # prefill
    engine.override_next_token(rid, engine.runner.vocab_size + 3)
    with pytest.raises(IndexError):
        engine.step()
    assert calls == [decode_cpu._BAD_TOKEN]


def test_compiled_decode_is_off_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_compiled(monkeypatch)
    _run(_engine(monkeypatch, "eager"), make_prompts(3, 10, 20), 5)
    assert calls == []


def test_a_bad_switch_value_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCANARY_CPU_DECODE", "fast")
    with pytest.raises(ValueError, match="KVCANARY_CPU_DECODE.*fast.*compiled, eager"):
        Engine(EngineConfig(model="builtin:tiny-swa", page_size=4, max_total_tokens=4096,
                            max_context_len=1024))  # fmt: skip


def test_a_wrapped_store_runs_the_eager_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault's wrapper on a sub-pool's set_kv_buffer (put on the real pool, as fault
    injection does) must see every store: the compiled forward steps aside, the wrapper
    sees the decode steps' stores, and the outputs are the eager forward's."""
    prompts = make_prompts(4, 10, 40, seed=1)
    want = [o.output_ids for o in _run(_engine(monkeypatch, "eager"), prompts, 8)]
    calls = _count_compiled(monkeypatch)
    engine = _engine(monkeypatch, "compiled")
    sub = engine.runner.token_to_kv_pool.full_kv_pool
    assert isinstance(sub, MHAKVPool)
    real, stores = sub.set_kv_buffer, []

    def watching(layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *a: Any, **kw: Any) -> Any:
        stores.append(int(loc.shape[0]))
        return real(layer, loc, k, v, *a, **kw)

    sub.set_kv_buffer = watching  # type: ignore[method-assign]
    got = [o.output_ids for o in _run(engine, prompts, 8)]
    assert calls == []
    assert got == want
    # every forward's full layers stored through it: decode steps store one row a request
    assert stores.count(4) >= 2 * 7


@pytest.mark.parametrize("real_data", ["partial", "all"])
def test_the_store_check_observes_the_compiled_stores(monkeypatch: pytest.MonkeyPatch,
                                                      real_data: str) -> None:  # fmt: skip
    """With the canary's store check on, decode still runs compiled and the check's observers
    get each observed layer's stored rows: the very rows in the K/V buffers at the write
    slots (else the check would report lost stores: none is), as many observations as the
    eager forward makes, the same tokens."""
    prompts = make_prompts(5, 10, 50, seed=2)
    canary = CanaryConfig(mode="log", real_data=real_data, real_data_layers="all")
    seen: list[int] = []
    real_observe = PagedAttentionBackend._observe

    def observing(observers: Any, local: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        seen.append(int(loc.shape[0]))
        real_observe(observers, local, loc, k, v)

    monkeypatch.setattr(PagedAttentionBackend, "_observe", staticmethod(observing))
    eager = _engine(monkeypatch, "eager", canary=canary)
    want = [o.output_ids for o in _run(eager, prompts, 8)]
    eager_seen, seen[:] = list(seen), []
    calls = _count_compiled(monkeypatch)
    engine = _engine(monkeypatch, "compiled", canary=canary)
    stored: list[bool] = []
    real_decode = PagedAttentionBackend.observe_decode

    def checking(observed: Any, k_rows: Any, v_rows: Any) -> None:
        backend = engine.runner.attn_backend
        for (i, _, local, loc), k, v in zip(observed, k_rows, v_rows, strict=True):
            sub, _ = backend._store_of(engine.runner.model.attention_specs[i].layer_id)
            stored.append(torch.equal(sub.k_buffer[local][loc], k) and torch.equal(sub.v_buffer[local][loc], v))
        real_decode(observed, k_rows, v_rows)

    monkeypatch.setattr(PagedAttentionBackend, "observe_decode", staticmethod(checking))
    got = [o.output_ids for o in _run(engine, prompts, 8)]
    assert calls and all(c == -1 for c in calls)
    assert stored and all(stored)
    assert got == want
    assert sorted(seen) == sorted(eager_seen) and seen
    assert engine.canary is not None and engine.canary.violations == []


def test_packed_linears_run_the_eager_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the eager forward's linears would take oneDNN's packed GEMM its bits are not
    sgemm's: the compiled forward steps aside."""
    monkeypatch.setenv("KVCANARY_CPU_GEMM", "onednn")
    from kvcanary.ops.cpu.gemm import cpu_gemm_mode

    cpu_gemm_mode.cache_clear()
    try:
        calls = _count_compiled(monkeypatch)
        _run(_engine(monkeypatch, "compiled"), make_prompts(2, 10, 20), 4)
        assert calls == []
    finally:
        monkeypatch.delenv("KVCANARY_CPU_GEMM")
        cpu_gemm_mode.cache_clear()


def test_no_decode_buffers_without_host_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend whose forward has no host key tables (nothing initialised) gives none."""
    engine = _engine(monkeypatch, "compiled")
    backend = engine.runner.attn_backend
    assert isinstance(backend, PagedAttentionBackend)
    assert backend.decode_buffers(engine.runner.model.attention_specs) is None


@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_sgemm_call_is_f_linear_bit_for_bit(m: int) -> None:
    addr = decode_cpu.sgemm_address()
    assert addr
    gen = torch.Generator().manual_seed(m)
    si, sf = np.empty(8, dtype=np.int32), np.empty(2, dtype=np.float32)
    for n, k in ((384, 128), (259, 128), (128, 256), (7, 5)):
        x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        out = torch.full((m, n), float("nan"))
        decode_cpu._linear(addr, x.numpy(), w.numpy(), out.numpy(), si, sf)
        assert torch.equal(out, F.linear(x, w))


def test_silu_mul_within_a_few_ulps_of_torch() -> None:
    gen = torch.Generator().manual_seed(0)
    inter = 67
    gu = torch.randn(5, 2 * inter, generator=gen) * 8
    gu[0, :6] = torch.tensor([-200.0, -88.5, -30.0, 0.0, 30.0, 200.0])
    out = np.empty((5, inter), dtype=np.float32)
    decode_cpu._silu_mul(gu.numpy(), inter, out, np.empty(inter, dtype=np.float32))
    want = F.silu(gu[:, :inter]) * gu[:, inter:]
    assert np.isfinite(out).all()
    torch.testing.assert_close(torch.from_numpy(out), want, rtol=4e-7 * 8, atol=1e-30)
    split = np.full((5, inter), np.nan, dtype=np.float32)  # rows among the threads: the same bits
    decode_cpu._silu_mul_parallel(gu.numpy(), inter, split)
    assert np.array_equal(split, out)


@pytest.mark.parametrize("where", ["module", "global"])
def test_a_forward_hook_runs_the_eager_forward(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """A forward hook on a module (a fault's, a user's instrumentation) must see its module
    run: with one, decode runs eagerly and the hook fires every decode step; without it
    again, compiled."""
    engine = _engine(monkeypatch, "compiled")
    calls = _count_compiled(monkeypatch)
    fired: list[int] = []

    def hook(module: Any, args: Any, out: Any) -> None:
        fired.append(int(args[0].shape[0]))

    mlp = engine.runner.model.layers[2].mlp
    handle = (mlp.register_forward_hook(hook) if where == "module"
              else torch.nn.modules.module.register_module_forward_hook(hook))  # fmt: skip
    try:
        _run(engine, make_prompts(3, 10, 20), 5)
    finally:
        handle.remove()
    assert calls == [] and len(fired) >= 5
    _run(engine, make_prompts(3, 10, 20), 5)
    assert calls and all(c == -1 for c in calls)
