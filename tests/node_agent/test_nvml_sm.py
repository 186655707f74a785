"""The NVML backend's per-process SM utilisation, without a GPU: NVML's answers given through pynvml's own types.

The stand-in answers as pynvml's `nvmlDeviceGetProcessUtilization` wrapper does over the C function (pynvml.py):
a list of `c_nvmlProcessUtilizationSample_t` (pid, timeStamp in µs, smUtil, ...), or `NVMLError` with
NVML_ERROR_NOT_FOUND when no process had a sample since `lastSeenTimeStamp` (nvml.h: "the documented answer when
there are no samples"), NVML_ERROR_NOT_SUPPORTED on GPUs without per-process accounting. The driver keeps several
samples per process (one per sampling period) and may hand back samples at or before the timestamp given.
tests/gpu/test_nvml.py runs the same calls on a real GPU where there is one.
"""

from __future__ import annotations

import logging

import pynvml
import pytest

from services.node_agent.nvml import NvmlBackend, process_sm


def sample(pid: int, stamp: int, sm: int) -> pynvml.c_nvmlProcessUtilizationSample_t:
    s = pynvml.c_nvmlProcessUtilizationSample_t()
    s.pid, s.timeStamp, s.smUtil, s.memUtil = pid, stamp, sm, 0
    return s


class Nvml:
    """pynvml's names the backend uses, answering from `answers[handle]` (samples, or an NVML return code)."""

    NVMLError = pynvml.NVMLError
    NVML_ERROR_NOT_FOUND = pynvml.NVML_ERROR_NOT_FOUND

    def __init__(self, answers: dict[str, list | int]) -> None:
        self.answers = answers
        self.asked: list[tuple[str, int]] = []

    def nvmlDeviceGetProcessUtilization(self, handle: str, since: int) -> list:
        self.asked.append((handle, since))
        answer = self.answers[handle]
        if isinstance(answer, int):
            raise pynvml.NVMLError(answer)
        return [s for s in answer]


def backend(nvml: Nvml, handles: dict[str, str]) -> NvmlBackend:
    b = NvmlBackend.__new__(NvmlBackend)  # without nvmlInit: no GPU here
    b.nvml, b._handles, b._sm_seen, b._sm_unsupported = nvml, handles, {}, set()
    return b


def test_samples_are_averaged_per_process_and_old_ones_skipped() -> None:
    samples = [sample(10, 100, 40), sample(10, 200, 60), sample(11, 150, 5), sample(12, 90, 99)]
    assert process_sm(samples, since=95) == ({10: 50.0, 11: 5.0}, 200)
    assert process_sm([], since=7) == ({}, 7)
    assert process_sm([sample(10, 300, 250)], since=0) == ({10: 100.0}, 300)  # never above the whole GPU


def test_backend_reads_from_the_last_timestamp_and_tells_idle_from_unknown(caplog: pytest.LogCaptureFixture) -> None:
    nvml = Nvml(
        {
            "h0": [sample(10, 1_000, 30), sample(10, 2_000, 50), sample(11, 2_000, 7)],
            "h1": pynvml.NVML_ERROR_NOT_FOUND,  # nothing ran since: every process idled
            "h2": pynvml.NVML_ERROR_NOT_SUPPORTED,  # cannot say
        }
    )
    b = backend(nvml, {"GPU-0": "h0", "GPU-1": "h1", "GPU-2": "h2"})
    with caplog.at_level(logging.WARNING):
        assert b.process_utilization() == {"GPU-0": {10: 40.0, 11: 7.0}, "GPU-1": {}}
        nvml.answers["h0"] = [sample(10, 2_000, 50), sample(10, 3_000, 20)]  # the driver repeats one it gave
        assert b.process_utilization() == {"GPU-0": {10: 20.0}, "GPU-1": {}}
    assert ("h0", 2_000) in nvml.asked and ("h0", 0) in nvml.asked  # the first read takes the driver's buffer
    assert [r.getMessage() for r in caplog.records].count(
        "no per-process SM utilisation on GPU GPU-2 (Not Supported): pods there show none"
    ) == 1  # said once, not every sample
