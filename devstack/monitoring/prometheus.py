"""A real Prometheus (Debian's `prometheus` package) scraping a local stack's services.

    prom = Prometheus(work_dir, {"extender": "127.0.0.1:12345", "node-agent-gpu-node-1": "127.0.0.1:9119"})
    prom.start()                       # installs the package on first use (apt-get, as root), waits until ready
    await prom.query("sum(gpushare_node_gpus)")
    prom.stop()

Each target is its own scrape target with a `service` label; `honor_labels` keeps the services' own `namespace`,
`pod` and `node` labels as they export them (what prometheus-adapter maps to Kubernetes objects).
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from devstack.cluster.buildtools import ControlPlaneUnavailable, Progress, apt_install, stderr_progress
from devstack.embedded import free_port
from devstack.monitoring.server import LocalServer, http_ok

PROMETHEUS_CANDIDATES = ("/usr/bin/prometheus",)


def ensure_prometheus(progress: Progress = stderr_progress) -> Path:
    """The prometheus binary, installing Debian's `prometheus` package when it is missing."""
    found = shutil.which("prometheus") or next((c for c in PROMETHEUS_CANDIDATES if os.access(c, os.X_OK)), None)
    if found:
        return Path(found)
    progress("prometheus not found; installing Debian package prometheus")
    apt_install(["prometheus"], progress)
    found = shutil.which("prometheus") or next((c for c in PROMETHEUS_CANDIDATES if os.access(c, os.X_OK)), None)
    if not found:
        raise ControlPlaneUnavailable("the prometheus package is installed but no prometheus binary was found")
    return Path(found)


def scrape_config(targets: dict[str, str], interval_s: float) -> dict[str, Any]:
    """prometheus.yml for `targets` (service name -> host:port), one static target each (pure)."""
    interval = f"{max(interval_s, 1):g}s"
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
        "scrape_configs": [
            {
                "job_name": "gpushare",
                "honor_labels": True,
                "static_configs": [
                    {"targets": [target], "labels": {"service": name}} for name, target in sorted(targets.items())
                ],
            }
        ],
    }


class Prometheus(LocalServer):
    """One Prometheus server process with its data under `work_dir`."""

    name = "prometheus"

    def __init__(
        self,
        work_dir: Path,
        targets: dict[str, str],
        *,
        scrape_interval_s: float = 1.0,
        port: int = 0,
        progress: Progress = stderr_progress,
    ) -> None:
        super().__init__(Path(work_dir) / "prometheus.log")
        self.work_dir = Path(work_dir)
        self.targets = dict(targets)
        self.scrape_interval_s = scrape_interval_s
        self.port = port or free_port()
        self.progress = progress
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> Prometheus:
        """Write the configuration, start the server and wait until it is ready."""
        binary = ensure_prometheus(self.progress)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config = self.work_dir / "prometheus.yml"
        config.write_text(json.dumps(scrape_config(self.targets, self.scrape_interval_s), indent=2))
        args = [
            str(binary),
            f"--config.file={config}",
            f"--storage.tsdb.path={self.work_dir / 'data'}",
            "--storage.tsdb.retention.time=1d",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        self.spawn(args, lambda: http_ok(f"{self.url}/-/ready"), timeout_s)
        self.progress(f"prometheus ready at {self.url}, scraping {len(self.targets)} target(s)")
        return self

    def api(self, path: str, **params: str) -> dict[str, Any]:
        """GET `/api/v1/<path>` and return its `data` (ValueError with Prometheus' error otherwise)."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise ValueError(f"prometheus {path} failed: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (ValueError naming the problem for invalid PromQL)."""
        data = self.api("query", query=expr)
        result = data["result"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": result}]
        return list(result)

    def targets_up(self) -> dict[str, str]:
        """Scrape target `service` label -> health (`up`, `down`, `unknown`)."""
        data = self.api("targets")
        return {t["labels"].get("service", t["scrapeUrl"]): t["health"] for t in data["activeTargets"]}
