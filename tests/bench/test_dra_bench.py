"""Benchmark 12 (bench/dra_paths.py): its arithmetic, and its tiny profile on the real v1.37.2 control plane (the
four paths through the same pods, each exercising what it says), so it keeps running."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest

from bench.__main__ import main
from bench.common import Context
from bench.dra_paths import PATHS, Flight, Idle, fits, little_bound, net, ratios, record, sizes
from devstack.cluster.releases import selected_release


def pod(name: str, node: str = "", phase: str = "Pending") -> dict:
    return {"metadata": {"name": name}, "spec": {"nodeName": node} if node else {}, "status": {"phase": phase}}


async def test_a_pod_frees_its_slot_once_when_first_seen_bound_and_is_timed_to_running() -> None:
    flight, free = Flight(created={"a": 10.0, "b": 10.5}), asyncio.Semaphore(0)
    record(flight, pod("a"), 10.2, free)
    record(flight, pod("a", "n1"), 11.0, free)
    record(flight, pod("a", "n1"), 11.3, free)  # seen again: not a second slot
    record(flight, pod("a", "n1", "Running"), 11.6, free)
    record(flight, pod("a", "n1", "Running"), 12.0, free)
    record(flight, pod("other", "n1", "Running"), 12.0, free)  # not this phase's
    assert flight.bound == {"a": 11.0} and flight.running == {"a": 11.6}
    assert free._value == 1  # one slot back, for one pod bound
    assert flight.creation_to_bound() == [1.0] and flight.bound_to_running() == pytest.approx([0.6])
    record(flight, pod("b", "n2", "Running"), 12.5, free)  # bound and running in one event
    assert flight.pods_per_s() == pytest.approx(2 / 2.5) and flight.running_span_s() == pytest.approx(2.5)


def test_background_is_taken_out_per_group_and_never_below_zero() -> None:
    idle = Idle({"binder": 0.2, "kube-apiserver": 1.0, "bench": 0.5}, seconds=10.0)
    assert idle.over(5.0) == {"binder": 0.1, "kube-apiserver": 0.5, "bench": 0.25}
    assert idle.cores() == pytest.approx(0.12)  # the load generator left out
    assert net({"binder": 0.4, "kube-apiserver": 0.3}, idle.over(5.0)) == pytest.approx(
        {"binder": 0.3, "kube-apiserver": 0.0}
    )


def test_ratios_put_the_dra_path_beside_the_extender_path_at_one_level() -> None:
    m = {
        "plain_c16_pods_per_s": 100.0,
        "extender_c16_pods_per_s": 50.0,
        "dra_c16_pods_per_s": 3.0,
        "extender_c16_product_cpu_ms_per_pod": 20.0,
        "dra_c16_product_cpu_ms_per_pod": 25.0,
        "extender_c16_to_bound_p50_ms": 200.0,
        "dra_c16_to_bound_p50_ms": 5200.0,
    }
    out = ratios(m, 16)
    assert out["dra_vs_extender_pods_per_s_c16"] == 0.06
    assert out["dra_vs_extender_product_cpu_ms_per_pod_c16"] == 1.25
    assert out["dra_vs_extender_to_bound_p50_ms_c16"] == 26.0
    assert out["extender_vs_plain_pods_per_s_c16"] == 0.5 and "dra_vs_extender_pods_per_s_c48" not in out
    assert little_bound(16, 5000.0) == 3.2 and little_bound(16, 0.0) == 0.0
    with_baseline = ratios({**m, "baseline_c16_pods_per_s": 4.0, "baseline_c16_to_bound_p50_ms": 260.0}, 16)
    assert with_baseline["dra_vs_baseline_pods_per_s_c16"] == 0.75
    assert with_baseline["dra_vs_baseline_to_bound_p50_ms_c16"] == 20.0


def test_the_prepare_wait_is_read_from_the_agents_histograms() -> None:
    from bench.prepare_wait import Reading, figures, quantile

    page = """# TYPE gpushare_node_agent_dra_prepare_ledger_wait_seconds histogram
gpushare_node_agent_dra_prepare_ledger_wait_seconds_bucket{{node="n",le="0.0"}} {zero}
gpushare_node_agent_dra_prepare_ledger_wait_seconds_bucket{{node="n",le="0.05"}} {fast}
gpushare_node_agent_dra_prepare_ledger_wait_seconds_bucket{{node="n",le="1.0"}} {all}
gpushare_node_agent_dra_prepare_ledger_wait_seconds_bucket{{node="n",le="+Inf"}} {all}
gpushare_node_agent_dra_prepare_ledger_wait_seconds_count{{node="n"}} {all}
gpushare_node_agent_dra_prepare_ledger_wait_seconds_sum{{node="n"}} {total}
# TYPE gpushare_node_agent_dra_prepares_total counter
gpushare_node_agent_dra_prepares_total{{node="n",outcome="prepared"}} {all}
gpushare_node_agent_dra_prepares_total{{node="n",outcome="refused"}} {refused}
"""
    before, after = Reading(), Reading()
    before.add(page.format(zero=1, fast=1, all=1, total=0.0, refused=0))
    after.add(page.format(zero=50, fast=98, all=100, total=1.5, refused=1))  # two agents, summed
    after.add(page.format(zero=0, fast=0, all=0, total=0.0, refused=0))
    got = figures(before, after, "dra_c16")
    assert got["dra_c16_prepare_calls"] == 99 and got["dra_c16_prepare_refused"] == 1
    assert got["dra_c16_prepare_ledger_wait_mean_ms"] == round(1.5 / 99 * 1000, 2)
    assert got["dra_c16_prepare_ledger_wait_p50_le_ms"] == 50.0  # 49 of 99 waited not at all: the p50 is in (0, 50ms]
    assert quantile({0.0: 49, 0.05: 97, 1.0: 99, float("inf"): 99}, 0.5) == 0.05
    assert got["dra_c16_prepare_ledger_wait_p99_le_ms"] == 1000.0 and quantile({}, 0.5) == 0.0


@pytest.mark.parametrize("profile", ["tiny", "quick", "full"])
def test_every_profile_fits_its_pool_with_in_flight_shares_counted_twice(profile: str, tmp_path: Path) -> None:
    s = sizes(Context(profile, "postgresql://unused", "nats://unused", tmp_path))
    assert fits(s) and max(s.levels) <= s.pods
    assert not fits(type(s)(s.nodes, s.nodes * 128, s.levels))


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.skipif(
    selected_release().minor < 36, reason=f"the DRA path needs Kubernetes 1.36+ (this run: {selected_release()})"
)
def test_tiny_profile_runs_the_four_paths_through_what_each_exercises(
    tmp_path: Path, pg_server_url: str, nats_url: str
) -> None:
    servers = ["--database-url", pg_server_url, "--nats-url", nats_url]
    code = main(["--profile", "tiny", "--only", "dra", "--out", str(tmp_path), *servers])
    doc = json.loads((tmp_path / "latest.json").read_text())
    (result,) = doc["results"]
    assert code == 0 and result["status"] == "ok", result["notes"]
    m, s = result["metrics"], sizes(Context("tiny", "", "", tmp_path))
    for level in s.levels:
        for path in PATHS:
            p = f"{path}_c{level}"
            assert m[f"{p}_bound"] == m[f"{p}_running"] == s.pods, p
            assert m[f"{p}_pods_per_s"] > 0 and m[f"{p}_to_bound_p99_ms"] >= m[f"{p}_to_bound_p50_ms"] > 0
            assert m[f"{p}_bound_to_running_p50_ms"] > 0 and m[f"{p}_cpu_ms_per_pod_kube_apiserver"] > 0
        # the extender path: kube-scheduler called the extender, the ledger holds every pod, the agents assigned
        assert m[f"extender_c{level}_extender_filter_calls_per_pod"] >= 1
        assert m[f"extender_c{level}_extender_bind_calls_per_pod"] >= 1
        assert m[f"extender_c{level}_ledger_assigned"] == s.pods and m[f"extender_c{level}_ledger_from_claims"] == 0
        # the DRA path: admission rewrote each pod, no scheduler verb reached the extender, every allocation came
        # from a claim and was assigned by the node agent's NodePrepareResources
        assert m[f"dra_c{level}_extender_admission_calls_per_pod"] >= 1
        assert not any(f"dra_c{level}_extender_{v}_calls_per_pod" in m for v in ("filter", "prioritize", "bind"))
        assert m[f"dra_c{level}_ledger_from_claims"] == m[f"dra_c{level}_ledger_assigned"] == s.pods
        # every DRA pod's claim was prepared, the wait for the ledger measured, its record timed against its bind
        assert m[f"dra_c{level}_prepare_calls"] >= s.pods and f"dra_c{level}_prepare_ledger_wait_mean_ms" in m
        assert f"dra_c{level}_recorded_after_bound_p50_ms" in m
        assert f"dra_vs_extender_pods_per_s_c{level}" in m and f"dra_vs_baseline_pods_per_s_c{level}" in m
        # the baseline: Kubernetes' DRA alone, nothing of gpushare: no webhook call, nothing in the ledger
        assert not any(f"baseline_c{level}_extender_{v}_calls_per_pod" in m for v in ("filter", "admission"))
        assert f"baseline_c{level}_ledger_allocations" not in m
        # ... but kubelet prepared every baseline claim through the minimal driver's plugin, as for any DRA driver
        assert m[f"baseline_c{level}_prepare_calls"] >= s.pods
        # the ledger's events: reserved, bound, assigned and released at least for a GPU pod, none for the others
        assert m[f"extender_c{level}_ledger_events_per_pod"] >= 4 and m[f"dra_c{level}_ledger_events_per_pod"] >= 4
        assert m[f"baseline_c{level}_ledger_events_per_pod"] < 1 and m[f"plain_c{level}_ledger_events_per_pod"] < 1
        assert not any(f"plain_c{level}_extender_{v}_calls_per_pod" in m for v in ("filter", "admission"))
    want = {f"dra_vs_baseline_pods_per_s_c{level}" for level in s.levels}
    want |= {f"dra_vs_extender_product_cpu_ms_per_pod_c{level}" for level in s.levels}
    assert {t["metric"] for t in result["targets"]} == want  # the tiny profile has no level of 16 in flight


def test_what_pods_cost_while_they_only_exist_is_scaled_to_their_presence() -> None:
    from bench.dra_paths import PhaseResult

    phase = PhaseResult(
        path="dra",
        level=16,
        flight=Flight(),
        cpu={},
        background={},
        seconds=0.0,
        calls={},
        api_before=Counter(),
        api_after=Counter(),
        db={},
        ledger=Counter(),
        torn_down=True,
        # 100 pods held 10 s: the binder 0.1 s, PostgreSQL 0.1 s, kube-apiserver 0.5 s, the load generator aside
        held={"binder": 0.1, "postgres": 0.1, "kube-apiserver": 0.5, "bench": 9.0},
        held_s=10.0,
        presence_s=100 * 40.0,  # each pod existed 40 s of the start window
    )
    assert phase.presence("dra_c16", 100) == {
        "dra_c16_presence_s_per_pod": 40.0,
        "dra_c16_held_product_cpu_us_per_pod_s": 200.0,  # 0.2 s / (100 pods x 10 s)
        "dra_c16_product_cpu_ms_per_pod_from_presence": 8.0,  # 200 us x 40 s
        "dra_c16_held_control_plane_cpu_us_per_pod_s": 500.0,
        "dra_c16_control_plane_cpu_ms_per_pod_from_presence": 20.0,
    }
