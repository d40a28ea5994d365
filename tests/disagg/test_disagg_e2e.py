"""Two processes on loopback (torch.distributed, gloo): prefill rank 0, decode rank 1.

Kept small (tiny models, a few short requests, deadlines everywhere): each cluster start
costs ~1 s of process spawn and model load."""

from __future__ import annotations

import pytest
from disagg_testlib import assert_side_clean, greedy, prompts, tiny_config

from kvcanary import Engine
from kvcanary.canary.config import CanaryConfig
from kvcanary.disagg.cluster import DisaggCluster
from kvcanary.disagg.config import DisaggConfig, DisaggFaults

DISAGG = DisaggConfig(transfer_timeout_s=30, connect_timeout_s=60, threads_per_worker=1)


def _run(config, batch, params, faults=None, disagg=DISAGG):
    with DisaggCluster(config, config, disagg, faults) as cluster:
        outs = cluster.generate(batch, params, timeout_s=60)
        reports = cluster.shutdown(timeout_s=30)
        return outs, reports, cluster.exitcodes


@pytest.mark.parametrize("model", ["builtin:tiny-swa", "builtin:tiny-mha"])
def test_two_processes_equal_colocated(model) -> None:
    config = tiny_config(model)
    batch = prompts(5, 40, 120, seed=11)
    outs, reports, exitcodes = _run(config, batch, greedy(16))
    expected = [o.output_ids for o in Engine(config).generate(batch, greedy(16))]
    assert [o.output_ids for o in outs] == expected
    assert exitcodes == {"prefill": 0, "decode": 0}
    assert reports["decode"]["transfers"] == 5
    assert reports["decode"]["tail_prealloc"] == (model == "builtin:tiny-swa")
    assert_side_clean(reports["prefill"])  # raise mode, silent
    assert_side_clean(reports["decode"])


@pytest.mark.parametrize(
    ("faults", "reason"),
    [(DisaggFaults(real_kv_post_forward=True), "verify_real_kv_hash"),
     (DisaggFaults(page_offset=1), "verify_position")],
)  # fmt: skip
def test_canary_across_the_wire(faults, reason) -> None:
    """A fault on the prefill side or in the transfer: only the decode side reports it, on
    the request's first decode forward (one request, so that is the decode side's first)."""
    outs, reports, _ = _run(tiny_config(canary=CanaryConfig(mode="log", real_data="partial")), prompts(1, 40, 60, seed=12), greedy(4),
                            faults)  # fmt: skip
    assert reports["prefill"]["canary"]["violations"] == []
    rows = reports["decode"]["canary"]["violations"]
    assert rows and min(r["step"] for r in rows) == 1
    assert any(reason in r["fail_reasons"] for r in rows)
    assert all(o.finish_reason == "length" for o in outs)


def test_prefill_crash_fails_affected_requests_without_hanging() -> None:
    config = tiny_config()
    outs, reports, exitcodes = _run(config, prompts(4, 40, 60, seed=13), greedy(8),
                                    DisaggFaults(crash_prefill_on_request=3))  # fmt: skip
    assert exitcodes["prefill"] == 17 and exitcodes["decode"] == 0
    assert reports["prefill"] is None
    failed = [o for o in outs if o.finish_reason == "error"]
    assert len(failed) >= 2  # the crash hit while requests 3 and 4 were in flight
    assert all("prefill worker unreachable" in o.error for o in failed)
    # Every pre-allocation was given back. Under load the prefill requests of 1 and 2 can
    # arrive in the same read as 3's, whose crash then fails all four: the decode side never
    # ran a forward, and its canary protected nothing (but must report nothing either).
    finished = [o for o in outs if o.finish_reason != "error"]
    assert all(o.finish_reason == "length" for o in finished)
    assert_side_clean(reports["decode"], canary=bool(finished))
    assert reports["decode"]["canary"]["stats"]["violations"] == 0
