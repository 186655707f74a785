"""Process faults on a replicated stack during a burst of GPU pods through the real kube-scheduler (issue 32).

Two extender replicas behind one address, two binders electing a leader, two accountings, and two v1.37.2
kube-schedulers electing a leader (`devstack.stack.Stack` with `replicas=2, schedulers=2`). One fault per round
(`process_faults.py`): kill -9 the leading binder; kill -9 one extender replica; kill -9 one extender replica and
the leading kube-scheduler. After each: every pod bound (none lost), none bound twice, no GPU overcommitted, the
ledger equal to the containers' environments and the pods' annotations, accounting's projection equal to a
replay. The recovery times are measured and recorded (GPUSHARE_RELIABILITY_RESULTS), not asserted;
GPUSHARE_SOAK=1 runs each fault three times and prints docs/reliability.md's table.
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

import pytest

from tests.e2e import helpers as h
from tests.reliability.process_faults import FAULTS, Round, run_round, table
from tests.reliability.profile import PROFILE

pytestmark = pytest.mark.e2e

RESULTS = Path(os.environ.get("GPUSHARE_RELIABILITY_RESULTS", "/tmp/gpushare-reliability-results.jsonl"))
log = logging.getLogger("reliability.process_faults")
ROUNDS: list[Round] = []
RUNS = 3 if PROFILE.soak else 1  # rounds per fault (docs/reliability.md: the soak's three)
PODS = 18 if PROFILE.soak else 12  # pods per round's burst
# kube-scheduler's lease as "DURATION,DEADLINE,RETRY" (e.g. "8s,6s,1s"; default: kube-scheduler's 15s, 10s, 2s)
SCHEDULER_LEASE = os.environ.get("GPUSHARE_SCHEDULER_LEASE", "")
# the e2e tier's module stack (`e2e_stack`, borrowed in tests/reliability/conftest.py), shaped by these names
STACK_NODES = 2
STACK_GPUS = "4x16GiB:Tesla-T4"
STACK_REPLICAS = 2
STACK_SCHEDULERS = 2
STACK_SCHEDULER_EXTRA: dict[str, object] = {}
if SCHEDULER_LEASE:
    duration, deadline, retry = (part.strip() for part in SCHEDULER_LEASE.split(","))
    STACK_SCHEDULER_EXTRA["leaderElection"] = {
        "leaseDuration": duration,
        "renewDeadline": deadline,
        "retryPeriod": retry,
    }


@pytest.mark.parametrize("fault", FAULTS)
async def test_a_process_fault_mid_burst_loses_no_pod_and_binds_none_twice(e2e_stack, fault: str) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(f"{PROFILE.seed}-{fault}")
    rounds = []
    for run in range(RUNS):
        result = await run_round(e2e_stack, fault, PODS, rng)
        rounds.append(result)
        _record(run, result)
        log.info("%s, run %d: %s", fault, run + 1, result.figures())
        api = await e2e_stack.api_client()
        for namespace in await _namespaces(api):
            await h.delete_all_pods(api, namespace)  # the capacity goes back for the next round
    ROUNDS.extend(rounds)
    print("\n" + "\n".join(table(ROUNDS)))
    assert e2e_stack.check_alive() == [], f"services died: {e2e_stack.check_alive()}"
    # both kube-schedulers call one address; every extender replica behind it took their connections
    endpoints = e2e_stack.service_proxies["extender"].endpoints
    assert all(e.connections > 0 for e in endpoints), [(e.port, e.connections) for e in endpoints]
    for r in rounds:
        assert not r.lost, f"{fault}: pods never bound: {r.lost}"
        assert not r.double_binds, f"{fault}: {r.double_binds}"
        assert not r.problems, f"{fault}: invariants broken:\n" + "\n".join(r.problems[:20])
        assert r.recovery_s is not None and r.takeover_s is not None


def _record(run: int, result: Round) -> None:
    """Append a round's figures to the results file (for docs/reliability.md)."""
    with RESULTS.open("a") as out:
        profile = "soak" if PROFILE.soak else "bounded"
        lease = SCHEDULER_LEASE or "default"
        figures = {"scenario": "process-faults", "profile": profile, "scheduler_lease": lease, "run": run}
        out.write(json.dumps({**figures, **result.figures()}) + "\n")


async def _namespaces(api) -> list[str]:  # type: ignore[no-untyped-def]
    from kubernetes_asyncio import client

    listed = (await client.CoreV1Api(api).list_namespace()).items
    return [n.metadata.name for n in listed if n.metadata.name.startswith("ha-")]
