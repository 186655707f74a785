"""Benchmark 1's seed extender is configured in kube-scheduler as its own repository configures it."""

from __future__ import annotations

from bench import peer


def test_the_peer_extender_entry_is_the_seeds_own() -> None:
    entry = peer.extender_config(12345).to_dict()
    assert entry["urlPrefix"] == "http://127.0.0.1:12345/gpushare-scheduler"
    assert entry["filterVerb"] == "filter" and entry["bindVerb"] == "bind"
    assert "prioritizeVerb" not in entry and "preemptVerb" not in entry
    assert entry["managedResources"] == [{"name": "aliyun.com/gpu-mem", "ignoredByScheduler": False}]
