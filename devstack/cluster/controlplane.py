"""A local Kubernetes control plane (the current release, or 1.20): etcd, apiserver, controller-manager, scheduler.

No kubelet and no containers: nodes are simulated through the API (see
``nodes.py``), and the real kube-scheduler binds pods to them, optionally
through a scheduler extender.  Usable synchronously (``start``/``stop``, ``with``)
and from asyncio (``async with``).
"""

from __future__ import annotations

import asyncio
import atexit
import datetime
import json
import os
import re
import secrets
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from devstack.embedded import free_port
from shared.annotations import RESOURCES

from .binaries import ControlPlaneUnavailable, Paths, Progress, ensure_binaries, stderr_progress
from .releases import CURRENT, Release

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient, Configuration

SERVICE_CIDR = "10.96.0.0/16"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
KUBECONFIG_NAME = "kubeconfig"  # the admin kubeconfig, in the work directory

# What kube-apiserver logs when its storage is inconsistent (the sources of k8s.io/apiserver v0.37.2):
# - "Too large resource version": `storage.NewTooLargeResourceVersionError` (pkg/storage/errors.go), returned when
#   a watch cache is not as fresh as etcd's revision within `blockTimeout` (3 s; pkg/storage/cacher/watch_cache.go
#   `waitUntilFreshAndBlock`), logged e.g. by `resourceSizeEstimator.cleanKeysIfNeeded` (pkg/storage/etcd3/
#   stats.go: "Error getting keys"), which asks each resource's cache once every `sizerRefreshInterval` (1 min,
#   jittered up to 1.5). On Debian's etcd 3.4.23 a cache never learns etcd's revision: it reports the same
#   `current` revision again and again. On a loaded machine a healthy cache may lag past the 3 s and catch up
#   (the client is told to retry): such a report names a `current` revision that no report a refresh later names
#   again, and is no error (`stuck_cache_reports`);
# - "Cache consistency check failed" / "Cache consistency check error": `Checker.check`
#   (pkg/storage/cacher/consistency/checker.go), the watch cache's digest differs from etcd's, or cannot be
#   compared (an error while the server stops, "context canceled", is not one).
TOO_LARGE_RESOURCE_VERSION = "Too large resource version"
CACHE_CHECK_MARKERS = ("Cache consistency check failed", "Cache consistency check error")
STUCK_AFTER_S = 60.0  # `sizerRefreshInterval`: a cache that reports one revision again this much later did not move
_KLOG_TIME = re.compile(r"^[IWEF](\d{2})(\d{2}) (\d{2}):(\d{2}):(\d{2}(?:\.\d+)?)")
_CURRENT = re.compile(r"current: (\d+)")


def storage_consistency_errors(log_text: str) -> list[str]:
    """The lines of a kube-apiserver log that report storage consistency errors (pure): failed cache consistency
    checks, and the reports of watch caches stuck behind etcd (`stuck_cache_reports`)."""
    lines = log_text.splitlines()
    stuck = stuck_cache_reports([line for line in lines if TOO_LARGE_RESOURCE_VERSION in line])
    return [line for line in lines if line in stuck or _failed_cache_check(line)]


def _failed_cache_check(line: str) -> bool:
    return any(m in line for m in CACHE_CHECK_MARKERS) and "context canceled" not in line


def stuck_cache_reports(reports: Sequence[str]) -> set[str]:
    """Of kube-apiserver's "Too large resource version" lines, those of a cache that did not move: its `current`
    revision is reported again at least `STUCK_AFTER_S` apart. A line without a klog time or a `current` revision
    is kept (nothing shows that the cache caught up)."""
    stuck: set[str] = set()
    by_current: dict[str, list[tuple[float, str]]] = {}
    for line in reports:
        when, current = _klog_seconds(line), _CURRENT.search(line)
        if when is None or current is None:
            stuck.add(line)
        else:
            by_current.setdefault(current[1], []).append((when, line))
    for seen in by_current.values():
        if max(seen)[0] - min(seen)[0] >= STUCK_AFTER_S:
            stuck.update(line for _, line in seen)
    return stuck


def _klog_seconds(line: str) -> float | None:
    """Seconds since the start of the year of a klog line's header (`I1206 22:18:32.515988 ...`), or None."""
    m = _KLOG_TIME.match(line)
    if m is None:
        return None
    day = datetime.date(2000, int(m[1]), int(m[2])).timetuple().tm_yday  # a leap year: 29 February parses
    return ((day * 24 + int(m[3])) * 60 + int(m[4])) * 60 + float(m[5])


@dataclass
class ExtenderConfig:
    """One entry of the scheduler's ``extenders:`` list (the same field names from v1beta1 to v1)."""

    url_prefix: str
    filter_verb: str | None = "filter"
    prioritize_verb: str | None = "prioritize"
    bind_verb: str | None = "bind"
    preempt_verb: str | None = "preempt"
    weight: int = 1
    http_timeout: str = "30s"
    node_cache_capable: bool = True
    managed_resources: Sequence[str] = RESOURCES
    # managed resources kube-scheduler leaves to the extender alone (`ignoredByScheduler: true`); none, as shipped
    # (k8s/scheduler/): kube-scheduler counts every aliyun.com/* resource per node as kubelet does at admission,
    # which is what makes it preempt for them (docs/extender.md, "Preemption")
    ignored_by_scheduler: Sequence[str] = ()
    ignorable: bool = False
    tls_config: Mapping[str, Any] | None = None  # for https: kube-scheduler's tlsConfig (default: insecure)

    def to_dict(self) -> dict[str, Any]:
        """Render as a KubeSchedulerConfiguration extender entry."""
        out: dict[str, Any] = {
            "urlPrefix": self.url_prefix.rstrip("/"),
            "weight": self.weight,
            "httpTimeout": self.http_timeout,
            "nodeCacheCapable": self.node_cache_capable,
            "enableHTTPS": self.url_prefix.startswith("https://"),
            "ignorable": self.ignorable,
            "managedResources": [
                {"name": n, "ignoredByScheduler": n in self.ignored_by_scheduler} for n in self.managed_resources
            ],
        }
        for key, verb in (
            ("filterVerb", self.filter_verb),
            ("prioritizeVerb", self.prioritize_verb),
            ("bindVerb", self.bind_verb),
            ("preemptVerb", self.preempt_verb),
        ):
            if verb:
                out[key] = verb
        if out["enableHTTPS"]:
            out["tlsConfig"] = dict(self.tls_config) if self.tls_config is not None else {"insecure": True}
        return out


ExtenderSpec = str | ExtenderConfig | None


def _as_extender(ext: ExtenderSpec) -> ExtenderConfig | None:
    return ExtenderConfig(url_prefix=ext) if isinstance(ext, str) else ext


SCHEDULER_LEASE = {"resourceLock": "leases", "resourceName": "kube-scheduler", "resourceNamespace": "kube-system"}
"""The Lease kube-scheduler replicas compete for (the defaults of its configuration, written out: 1.20's v1beta1
defaults the lock to `endpointsleases`)."""


def scheduler_config(
    kubeconfig: Path,
    extender: ExtenderSpec = None,
    scheduler_name: str = "default-scheduler",
    healthz_address: str | None = None,
    extra: dict[str, Any] | None = None,
    release: Release = CURRENT,
    leader_elect: bool = False,
) -> dict[str, Any]:
    """Build the KubeSchedulerConfiguration `release` reads (v1 from 1.25, v1beta1 for 1.20).

    `healthz_address` only applies to releases whose configuration still has `healthzBindAddress` (before
    v1); later ones serve /healthz on `--secure-port`. `leader_elect`: the replicas elect one through the Lease
    `kube-system/kube-scheduler` (lease duration, renew deadline and retry period as kube-scheduler defaults
    them, 15 s, 10 s and 2 s, unless `extra` sets them under `leaderElection`). `extra` adds top-level fields; a
    mapping given for one that is already a mapping (`clientConnection`, say) is merged into it.
    """
    cfg: dict[str, Any] = {
        "apiVersion": release.scheduler_api_version,
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "leaderElection": {"leaderElect": True, **SCHEDULER_LEASE} if leader_elect else {"leaderElect": False},
        "profiles": [{"schedulerName": scheduler_name}],
    }
    if healthz_address and release.has_insecure_port_flags:
        cfg["healthzBindAddress"] = healthz_address
        cfg["metricsBindAddress"] = healthz_address
    ext = _as_extender(extender)
    if ext is not None:
        cfg["extenders"] = [ext.to_dict()]
    for key, value in (extra or {}).items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def free_ports(n: int) -> list[int]:
    """``n`` TCP ports free on 127.0.0.1 now, none handed out before by this process (`devstack.embedded.free_port`:
    two calls may otherwise get the same port from the kernel, and the second server cannot listen)."""
    return [free_port() for _ in range(n)]


@dataclass
class _Proc:
    name: str
    args: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)


class ControlPlane:
    """Runs etcd + kube-apiserver + kube-controller-manager + kube-scheduler locally.

    ``extender`` is a URL prefix string, an ``ExtenderConfig``, or None (no extender). ``schedulers`` > 1 runs
    that many kube-scheduler processes (``kube-scheduler``, ``kube-scheduler-2``, ...) electing a leader through
    the Lease ``kube-system/kube-scheduler``, as a highly available control plane does.
    Attributes after ``start()``: ``kubeconfig_path``, ``server_url``, ``token``,
    ``work_dir``, ``logs`` (component name -> log file).
    """

    def __init__(
        self,
        extender: ExtenderSpec = None,
        *,
        scheduler_name: str = "default-scheduler",
        scheduler_extra: dict[str, Any] | None = None,
        keep: bool = False,
        work_dir: Path | str | None = None,
        paths: Paths | None = None,
        progress: Progress = stderr_progress,
        startup_timeout: float = 60.0,
        verbosity: int = 2,
        authorization_mode: str = "AlwaysAllow",
        users: dict[str, str] | None = None,
        controller_manager_extra: Sequence[str] = (),
        schedulers: int = 1,
        service_account_tokens: bool = False,
    ) -> None:
        if schedulers < 1:
            raise ValueError(f"at least one kube-scheduler, not {schedulers}")
        self.schedulers = schedulers
        self.extender = _as_extender(extender)
        self.authorization_mode = authorization_mode  # e.g. "RBAC": then `users` get only what is bound to them
        self.users = dict(users or {})  # user name -> bearer token, in no group (the admin is in system:masters)
        self.controller_manager_extra = list(controller_manager_extra)
        # Pods get their service account's token (the ServiceAccount admission plugin, off by default: pods of the
        # tests that never reach the API server then need no account) and the serving certificate's CA
        # (`kube-root-ca.crt`), so in-cluster clients in real containers reach the API server.
        self.service_account_tokens = service_account_tokens
        self.scheduler_name = scheduler_name
        self.scheduler_extra = scheduler_extra
        self.keep = keep
        self.progress = progress
        self.startup_timeout = startup_timeout
        self.verbosity = verbosity
        self._paths = paths
        self._work_dir_arg = Path(work_dir) if work_dir else None
        self.work_dir: Path = Path()
        self.token = secrets.token_hex(16)
        self.server_url = ""
        self.kubeconfig_path: Path = Path()
        self.cert_kubeconfig_path: Path = Path()  # the same cluster, a client-certificate user
        self.logs: dict[str, Path] = {}
        self._procs: dict[str, _Proc] = {}
        self._etcd_data: Path | None = None
        self._owns_work_dir = False
        self._started = False
        self.startup_seconds: float = 0.0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> ControlPlane:
        """Obtain binaries, start every component, wait until the apiserver is ready."""
        if self._started:
            return self
        t0 = time.monotonic()
        paths = self._paths or ensure_binaries(progress=self.progress)
        self._paths = paths
        if self._work_dir_arg:
            self.work_dir = self._work_dir_arg
            self.work_dir.mkdir(parents=True, exist_ok=True)
        else:
            self.work_dir = Path(tempfile.mkdtemp(prefix="gpushare-devcluster-"))
            self._owns_work_dir = True
        self._started = True
        atexit.register(self.stop)
        try:
            self._prepare_files()
            self._start_etcd()
            self._start_apiserver()
            self._start_controller_manager()
            self._start_scheduler()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        self.progress(
            f"control plane ready at {self.server_url} in "
            f"{self.startup_seconds:.1f}s (kubeconfig {self.kubeconfig_path})"
        )
        return self

    def stop(self) -> None:
        """Terminate all components (SIGTERM, then SIGKILL) and remove temp dirs."""
        if not self._started:
            return
        for name in (*self.scheduler_names, "kube-controller-manager", "kube-apiserver", "etcd"):
            self._stop_proc(name)
        self._started = False
        atexit.unregister(self.stop)
        if self._etcd_data and not self.keep:
            shutil.rmtree(self._etcd_data, ignore_errors=True)
        if self._owns_work_dir and not self.keep:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> ControlPlane:
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    @property
    def release(self) -> Release:
        """The Kubernetes release this control plane runs."""
        return self._paths.release if self._paths is not None else CURRENT

    @property
    def pids(self) -> dict[str, int]:
        """PIDs of the component processes started so far."""
        return {n: p.popen.pid for n, p in self._procs.items() if p.popen is not None}

    def running(self) -> dict[str, bool]:
        """Whether each component process is still alive."""
        return {n: p.popen is not None and p.popen.poll() is None for n, p in self._procs.items()}

    # ------------------------------------------------------------------ restarts
    @property
    def scheduler_names(self) -> list[str]:
        """The kube-scheduler processes' names: `kube-scheduler`, then `kube-scheduler-2`, ..."""
        return ["kube-scheduler", *(f"kube-scheduler-{i}" for i in range(2, self.schedulers + 1))]

    def restart_scheduler(self, extender: ExtenderSpec | bool = False, *, scheduler_name: str | None = None) -> None:
        """Restart only kube-scheduler (every replica); ``extender`` replaces the config unless False."""
        if extender is not False:
            self.extender = _as_extender(extender)  # type: ignore[arg-type]
        if scheduler_name is not None:
            self.scheduler_name = scheduler_name
        for name in self.scheduler_names:
            self._stop_proc(name)
        self._start_scheduler()

    def kill_component(self, name: str) -> None:
        """SIGKILL one component (no clean shutdown: a leader releases nothing); ``start_component`` revives it."""
        proc = self._procs.get(name)
        if proc is not None and proc.popen is not None and proc.popen.poll() is None:
            proc.popen.kill()
            proc.popen.wait(10)

    def leading_scheduler(self) -> str | None:
        """The running kube-scheduler that holds the leader lease now, by its log (client-go logs "Successfully
        acquired lease" once per incarnation; the lease's holder identity is host name + a random UUID, the same
        host for every replica here). None while no replica leads."""
        running = self.running()
        for name in self.scheduler_names:
            if running.get(name) and LEASE_ACQUIRED in _current_incarnation(self.logs[name]):
                return name
        return None

    def restart_apiserver(self, down_seconds: float = 0.0, grace: float = 2.0) -> None:
        """Stop kube-apiserver, optionally stay down a while, start it on the same port.

        With clients connected the apiserver rarely exits on SIGTERM quickly, so
        it is SIGKILLed after ``grace`` seconds.
        """
        self._stop_proc("kube-apiserver", grace)
        if down_seconds:
            time.sleep(down_seconds)
        self._spawn(self._procs["kube-apiserver"])
        self._wait_apiserver()

    def stop_component(self, name: str, grace: float = 10.0) -> None:
        """Stop one component (SIGTERM, SIGKILL after ``grace``); ``start_component`` revives it."""
        self._stop_proc(name, grace)

    def start_component(self, name: str) -> None:
        """Start a component previously stopped with ``stop_component``."""
        self._spawn(self._procs[name])
        if name == "kube-apiserver":
            self._wait_apiserver()

    # ------------------------------------------------------------------ clients
    def client_configuration(self) -> Configuration:
        """A kubernetes_asyncio Configuration for this cluster (token, no TLS verify)."""
        from kubernetes_asyncio.client import Configuration

        conf = Configuration(host=self.server_url)
        conf.api_key = {"BearerToken": self.token, "authorization": self.token}
        conf.api_key_prefix = {"BearerToken": "Bearer", "authorization": "Bearer"}
        conf.verify_ssl = False
        return conf

    def api_client(self) -> ApiClient:
        """A new kubernetes_asyncio ApiClient (use ``async with`` or close it)."""
        from kubernetes_asyncio.client import ApiClient

        from shared.kube.client import skip_environment_lookups

        api = ApiClient(configuration=self.client_configuration())
        skip_environment_lookups(api)
        return api

    def user_kubeconfig(self, user: str, path: Path) -> Path:
        """Write a kubeconfig for one of `users` (their token instead of the admin's) to `path`."""
        config = json.loads(self.kubeconfig_path.read_text())
        config["users"] = [{"name": user, "user": {"token": self.users[user]}}]
        config["contexts"][0]["context"]["user"] = user
        path.write_text(json.dumps(config, indent=2))
        path.chmod(0o600)
        return path

    def env(self) -> dict[str, str]:
        """Environment variables pointing clients (kubectl, services) at this cluster."""
        return {"KUBECONFIG": str(self.kubeconfig_path)}

    def log_tail(self, name: str, nbytes: int = 4000) -> str:
        """Last bytes of one component's log, for error messages."""
        path = self.logs.get(name)
        if not path or not path.exists():
            return ""
        return path.read_bytes()[-nbytes:].decode(errors="replace")

    def storage_consistency_errors(self) -> list[str]:
        """kube-apiserver's storage consistency errors so far (`storage_consistency_errors`; read its whole log)."""
        path = self.logs.get("kube-apiserver")
        if not path or not path.exists():
            return []
        return storage_consistency_errors(path.read_bytes().decode(errors="replace"))

    @property
    def etcd_url(self) -> str:
        """etcd's client URL."""
        return f"http://127.0.0.1:{self._etcd_port}"

    # ------------------------------------------------------------------ internals
    def _prepare_files(self) -> None:
        wd = self.work_dir
        (wd / "certs").mkdir(exist_ok=True)
        self._etcd_port, self._etcd_peer_port, self._api_port, *self._sched_ports = free_ports(3 + self.schedulers)
        self.server_url = f"https://127.0.0.1:{self._api_port}"
        tokens = [f'{self.token},admin,admin,"system:masters"'] + [f"{t},{u},{u}" for u, t in self.users.items()]
        (wd / "tokens.csv").write_text("\n".join(tokens) + "\n")
        sa_key = wd / "certs" / "sa.key"
        sa_pub = wd / "certs" / "sa.pub"
        if shutil.which("openssl") is None:
            raise ControlPlaneUnavailable("openssl CLI not found (needed for service-account keys)")
        for cmd in (
            ["openssl", "genrsa", "-out", str(sa_key), "2048"],
            ["openssl", "rsa", "-in", str(sa_key), "-pubout", "-out", str(sa_pub)],
        ):
            res = subprocess.run(cmd, capture_output=True, check=False)
            if res.returncode:
                raise ControlPlaneUnavailable(f"{' '.join(cmd)} failed: {res.stderr.decode()}")
        self.kubeconfig_path = wd / KUBECONFIG_NAME
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "gpushare-dev", "cluster": {"server": self.server_url, "insecure-skip-tls-verify": True}}
            ],
            "users": [{"name": "admin", "user": {"token": self.token}}],
            "contexts": [
                {
                    "name": "gpushare-dev",
                    "context": {"cluster": "gpushare-dev", "user": "admin", "namespace": "default"},
                }
            ],
            "current-context": "gpushare-dev",
        }
        self.kubeconfig_path.write_text(json.dumps(kubeconfig, indent=2))
        self.kubeconfig_path.chmod(0o600)
        self._client_certificate_kubeconfig(kubeconfig)
        self._front_proxy_certificates()
        self._kubelet_client_certificate()
        shm = Path("/dev/shm")
        if shm.is_dir() and os.access(shm, os.W_OK):
            self._etcd_data = Path(tempfile.mkdtemp(prefix="gpushare-etcd-", dir=shm))
        else:
            self._etcd_data = wd / "etcd-data"

    def _client_certificate_kubeconfig(self, token_config: dict[str, Any]) -> None:
        """A second kubeconfig whose user is a client certificate (CN admin, O system:masters) signed by a CA of
        this cluster (`--client-ca-file`): the other ordinary way managed clusters hand out access."""
        key, crt = self._ca_and_client_cert(
            "client-ca", "gpushare-dev-client-ca", "admin", "/O=system:masters/CN=admin"
        )
        config = json.loads(json.dumps(token_config))
        config["users"] = [{"name": "admin-cert", "user": {"client-certificate": str(crt), "client-key": str(key)}}]
        config["contexts"][0]["context"]["user"] = "admin-cert"
        self.cert_kubeconfig_path = self.work_dir / "kubeconfig-client-cert"
        self.cert_kubeconfig_path.write_text(json.dumps(config, indent=2))
        self.cert_kubeconfig_path.chmod(0o600)

    def _front_proxy_certificates(self) -> None:
        """The aggregation layer's front proxy: a CA extension API servers trust for forwarded requests
        (`--requestheader-client-ca-file`, published in kube-system's `extension-apiserver-authentication`) and the
        client certificate kube-apiserver proxies with (CN `front-proxy-client`)."""
        self._ca_and_client_cert("front-proxy-ca", "gpushare-dev-front-proxy-ca", "front-proxy-client",
                                 "/CN=front-proxy-client")  # fmt: skip

    def _kubelet_client_certificate(self) -> None:
        """The client certificate kube-apiserver shows a kubelet (`kubectl logs`, `exec`), signed by a CA of its own
        that real local kubelets trust (`kubelet_client_ca`, devstack/cluster/realkubelet.py)."""
        self._ca_and_client_cert("kubelet-client-ca", "gpushare-dev-kubelet-client-ca", "apiserver-kubelet-client",
                                 "/O=system:masters/CN=kube-apiserver-kubelet-client")  # fmt: skip

    @property
    def kubelet_client_ca(self) -> Path:
        """The CA of kube-apiserver's kubelet client certificate: a kubelet trusting it serves the API server."""
        return self.work_dir / "certs" / "kubelet-client-ca.crt"

    def _ca_and_client_cert(self, ca: str, ca_cn: str, client: str, subject: str) -> tuple[Path, Path]:
        """A CA `certs/<ca>.{key,crt}` (CN `ca_cn`) and a client key and certificate `certs/<client>.{key,crt}` it
        signed for `subject`, all valid 2 days; returns (client key, client certificate)."""
        certs = self.work_dir / "certs"
        ca_key, ca_crt = certs / f"{ca}.key", certs / f"{ca}.crt"
        key, csr, crt = (certs / f"{client}.{ext}" for ext in ("key", "csr", "crt"))
        for cmd in (
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca_crt),
             "-days", "2", "-subj", f"/CN={ca_cn}"],
            ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
             "-subj", subject],
            ["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key),
             "-CAcreateserial", "-out", str(crt), "-days", "2"],
        ):  # fmt: skip
            res = subprocess.run(cmd, capture_output=True, check=False)
            if res.returncode:
                raise ControlPlaneUnavailable(f"{' '.join(cmd[:3])} failed: {res.stderr.decode()[-500:]}")
        return key, crt

    def _aggregation_flags(self) -> list[str]:
        """kube-apiserver's aggregation layer (APIService objects, e.g. custom.metrics.k8s.io). An APIService's
        Service is reached at its cluster IP (no kube-proxy here) unless it is an ExternalName, such as
        `localhost`: loopback addresses are not allowed in Endpoints or EndpointSlices, so
        `--enable-aggregator-routing` cannot reach a local process, and `devstack.monitoring.adapter` uses an
        ExternalName Service."""
        certs = self.work_dir / "certs"
        return [
            f"--requestheader-client-ca-file={certs / 'front-proxy-ca.crt'}",
            "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={certs / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={certs / 'front-proxy-client.key'}",
        ]

    def _spawn(self, proc: _Proc) -> None:
        self.logs[proc.name] = proc.log
        with proc.log.open("ab") as fh:
            fh.write(f"\n==== starting {proc.name} at {time.ctime()}\n".encode())
            fh.flush()
            proc.popen = subprocess.Popen(
                proc.args,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.work_dir,
            )
        self._procs[proc.name] = proc

    def _stop_proc(self, name: str, timeout: float = 10.0) -> None:
        proc = self._procs.get(name)
        if proc is None or proc.popen is None or proc.popen.poll() is not None:
            return
        proc.popen.send_signal(signal.SIGTERM)
        try:
            proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait(5)

    def _check_alive(self, name: str) -> None:
        p = self._procs[name].popen
        if p is not None and p.poll() is not None:
            raise ControlPlaneUnavailable(
                f"{name} exited with code {p.returncode}; log {self.logs[name]}:\n{self.log_tail(name)}"
            )

    def _wait(self, name: str, probe: Any, what: str) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            self._check_alive(name)
            if probe():
                return
            time.sleep(0.2)
        raise ControlPlaneUnavailable(
            f"{name} not {what} after {self.startup_timeout:.0f}s; log {self.logs[name]}:\n{self.log_tail(name)}"
        )

    def _http_ok(self, url: str, auth: bool = False) -> bool:
        req = urllib.request.Request(url)
        if auth:
            req.add_header("Authorization", f"Bearer {self.token}")
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        try:
            with urllib.request.urlopen(req, timeout=2, context=ctx) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _start_etcd(self) -> None:
        assert self._paths is not None and self._etcd_data is not None
        client = f"http://127.0.0.1:{self._etcd_port}"
        peer = f"http://127.0.0.1:{self._etcd_peer_port}"
        args = [
            str(self._paths.etcd),
            "--name=devcluster",
            f"--data-dir={self._etcd_data}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=devcluster={peer}",
            "--initial-cluster-state=new",
            "--log-level=warn",
        ]
        self._spawn(_Proc("etcd", args, self.work_dir / "etcd.log"))
        self._wait("etcd", lambda: self._http_ok(f"{client}/health"), "healthy")
        self.progress(f"etcd healthy on {client}")

    def _start_apiserver(self) -> None:
        assert self._paths is not None
        certs = self.work_dir / "certs"
        args = [
            str(self._paths.kube_apiserver),
            f"--etcd-servers=http://127.0.0.1:{self._etcd_port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self._api_port}",
            *(["--insecure-port=0"] if self.release.has_insecure_port_flags else []),
            f"--cert-dir={certs}",
            f"--token-auth-file={self.work_dir / 'tokens.csv'}",
            f"--client-ca-file={certs / 'client-ca.crt'}",
            f"--authorization-mode={self.authorization_mode}",
            f"--service-account-key-file={certs / 'sa.pub'}",
            f"--service-account-signing-key-file={certs / 'sa.key'}",
            f"--service-account-issuer={SA_ISSUER}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            *([] if self.service_account_tokens else ["--disable-admission-plugins=ServiceAccount"]),
            "--endpoint-reconciler-type=none",
            "--allow-privileged=true",
            "--profiling=false",
            # kubelets (real local nodes) are reached at their node's InternalIP, 127.0.0.1, and the port the node
            # reports, with this client certificate; their Hostname address (the node name) resolves nowhere
            "--kubelet-preferred-address-types=InternalIP",
            f"--kubelet-client-certificate={certs / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={certs / 'apiserver-kubelet-client.key'}",
            *self._aggregation_flags(),
            f"--v={self.verbosity}",
        ]
        self._spawn(_Proc("kube-apiserver", args, self.work_dir / "kube-apiserver.log"))
        self._wait_apiserver()
        self.progress(f"kube-apiserver ready on {self.server_url}")

    def _wait_apiserver(self) -> None:
        self._wait(
            "kube-apiserver",
            lambda: (
                self._http_ok(f"{self.server_url}/readyz", auth=True)
                and self._http_ok(f"{self.server_url}/api/v1/namespaces/default", auth=True)
            ),
            "ready",
        )

    def _start_controller_manager(self) -> None:
        assert self._paths is not None
        args = [
            str(self._paths.kube_controller_manager),
            f"--kubeconfig={self.kubeconfig_path}",
            "--controllers=*,-nodelifecycle",
            f"--service-account-private-key-file={self.work_dir / 'certs' / 'sa.key'}",
            "--use-service-account-credentials=false",
            # the CA pods trust the API server with (the kube-root-ca.crt ConfigMap): its self-signed serving
            # certificate (kube-apiserver writes it into --cert-dir)
            *([f"--root-ca-file={self.work_dir / 'certs' / 'apiserver.crt'}"] if self.service_account_tokens else []),
            "--leader-elect=false",
            "--secure-port=0",
            *(["--port=0"] if self.release.has_insecure_port_flags else []),
            *self.controller_manager_extra,
            f"--v={self.verbosity}",
        ]
        self._spawn(_Proc("kube-controller-manager", args, self.work_dir / "kube-controller-manager.log"))
        time.sleep(0.3)
        self._check_alive("kube-controller-manager")

    def _start_scheduler(self) -> None:
        for name, port in zip(self.scheduler_names, self._sched_ports, strict=True):
            self._start_one_scheduler(name, port)
        running = "kube-scheduler running" if self.schedulers == 1 else f"{self.schedulers} kube-schedulers running"
        self.progress(running + (f" with extender {self.extender.url_prefix}" if self.extender else ""))

    def _start_one_scheduler(self, name: str, port: int) -> None:
        assert self._paths is not None
        healthz = f"127.0.0.1:{port}"
        cfg = scheduler_config(
            self.kubeconfig_path,
            self.extender,
            self.scheduler_name,
            healthz_address=healthz,
            extra=self.scheduler_extra,
            release=self.release,
            leader_elect=self.schedulers > 1,
        )
        cfg_path = self.work_dir / f"{name}.json"
        cfg_path.write_text(json.dumps(cfg, indent=2))
        args = [str(self._paths.kube_scheduler), f"--config={cfg_path}", f"--v={self.verbosity}"]
        if self.release.has_insecure_port_flags:
            args.append("--secure-port=0")
            healthz_url = f"http://{healthz}/healthz"
        else:  # /healthz is served on the secure port only, and open to anyone by default
            args += ["--bind-address=127.0.0.1", f"--secure-port={port}"]
            healthz_url = f"https://{healthz}/healthz"
        self._spawn(_Proc(name, args, self.work_dir / f"{name}.log"))
        self._wait(name, lambda: self._http_ok(healthz_url), "healthy")


# client-go's leaderelection.go logs "Successfully acquired lease" (1.20's: "successfully acquired lease")
LEASE_ACQUIRED = "uccessfully acquired lease"
START_MARK = b"\n==== starting "  # what `_spawn` writes into a component's log before each start


def _current_incarnation(log: Path) -> str:
    """The part of a component's log written since its last start."""
    try:
        data = log.read_bytes()
    except OSError:
        return ""
    return data[data.rfind(START_MARK) + 1 :].decode(errors="replace")


def start_control_plane(extender: ExtenderSpec = None, **kwargs: Any) -> ControlPlane:
    """Convenience: construct and start a ControlPlane."""
    return ControlPlane(extender, **kwargs).start()
