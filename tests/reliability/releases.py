"""The previous release's code, runnable beside this checkout's: for upgrade tests.

The previous release is the newest commit, following first parents back from HEAD, whose pyproject.toml names
another version than this checkout's (on main after a release's merge: the last commit of the release before).
Its tree is extracted with `git archive` into a folder of its own (no worktree is registered in the repository),
its kubelet gRPC modules generated there, and its commands run with this interpreter and its installed
dependencies, importing that tree's packages instead of this checkout's (`PYTHONSAFEPATH` keeps the working
directory off `sys.path`; `PYTHONPATH` puts the old tree first).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from devstack.stack.spec import ServiceCommand

REPO = Path(__file__).resolve().parents[2]
TREE_ENV = ("PYTHONPATH", "PYTHONSAFEPATH", "GPUSHARE_TEST_LISTEN_HOST")
LOOPBACK_SITE = Path(__file__).resolve().parent / "loopback_site"
SERVICES = ("extender", "binder", "accounting", "node-agent")


@dataclass(frozen=True)
class Release:
    """A release's version, commit and extracted source tree."""

    version: str
    commit: str
    tree: Path

    def env(self) -> dict[str, str]:
        """Environment that makes `python -m services.cli` run this release's code."""
        return {"PYTHONPATH": str(self.tree), "PYTHONSAFEPATH": "1"}

    def knows(self, service: str, flag: str) -> bool:
        """Whether this release's `gpushare <service>` accepts `flag` (read from its CLI module)."""
        cli = self.tree / "services" / service.replace("-", "_") / "cli.py"
        return cli.is_file() and f'"{flag}"' in cli.read_text()

    def command(self, command: ServiceCommand) -> ServiceCommand:
        """`command` as this release's code runs it: the same arguments, except a `--host` its node agent does not
        know yet (0.1.0's listened on every address), which is then applied through `loopback_site`."""
        argv, env = list(command.argv), {**current(command).env, **self.env()}
        service = next((a for a in argv if a in SERVICES), "")
        if "--host" in argv and service and not self.knows(service, "--host"):
            at = argv.index("--host")
            env["GPUSHARE_TEST_LISTEN_HOST"] = argv[at + 1]
            env["PYTHONPATH"] = os.pathsep.join([str(LOOPBACK_SITE), env["PYTHONPATH"]])
            del argv[at : at + 2]
        return dataclasses.replace(command, argv=argv, env=env)

    def run(self, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        """`gpushare ARGS` of this release, to completion."""
        return subprocess.run(
            [sys.executable, "-m", "services.cli", *args],
            cwd=self.tree,
            env={**os.environ, **self.env()},
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )


def current(command: ServiceCommand) -> ServiceCommand:
    """`command` as this checkout's code runs it (with the `--host` an old release's form of it went without)."""
    argv = list(command.argv)
    host = command.env.get("GPUSHARE_TEST_LISTEN_HOST")
    if host and "--host" not in argv:
        argv += ["--host", host]
    env = {k: v for k, v in command.env.items() if k not in TREE_ENV}
    return dataclasses.replace(command, argv=argv, env=env)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout


def version_at(commit: str | None = None) -> str:
    """pyproject.toml's version in `commit` (None: this checkout's working tree)."""
    text = (REPO / "pyproject.toml").read_text() if commit is None else _git("show", f"{commit}:pyproject.toml")
    return tomllib.loads(text)["project"]["version"]


def previous_release_commit() -> tuple[str, str] | None:
    """(version, commit) of the previous release, or None when the history holds none (a shallow clone)."""
    ours = version_at()
    for commit in _git("rev-list", "--first-parent", "HEAD").split():
        try:
            theirs = version_at(commit)
        except subprocess.CalledProcessError:
            continue
        if theirs != ours:
            return theirs, commit
    return None


def extract(version: str, commit: str, into: Path) -> Release:
    """The tree of `commit` in `into`, with its kubelet gRPC modules generated, ready to run."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.Popen(["git", "archive", "--format=tar", commit], cwd=REPO, stdout=subprocess.PIPE)
    untar = subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, capture_output=True, check=False)
    if archive.stdout is not None:
        archive.stdout.close()
    if archive.wait() != 0 or untar.returncode != 0:
        raise RuntimeError(f"git archive {commit} failed: {untar.stderr.decode(errors='replace')}")
    release = Release(version, commit, into)
    generated = subprocess.run(
        [sys.executable, "-m", "shared.kubelet_api"],
        cwd=into,
        env={**os.environ, **release.env()},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if generated.returncode != 0:
        raise RuntimeError(f"generating {version}'s kubelet modules failed:\n{generated.stderr[-2000:]}")
    return release
