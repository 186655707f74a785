"""CUDA MPS on a node: whether its control daemon runs, and what a container needs to be its client (pure but
for one `exists` check).

`k8s/components/mps` runs `nvidia-cuda-mps-control` on the nodes labelled `gpushare.io/mps=true`, with its pipe
directory at `<root>/pipe` and its `/dev/shm` at `<root>/shm` on the host. A node agent started with
`--mps-root <root>` hands out MPS limits (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`)
while the daemon's `control` pipe exists, and makes the container a client: `CUDA_MPS_PIPE_DIRECTORY` and both
directories mounted (as NVIDIA's device plugin does for its MPS sharing). Without the daemon, no MPS variables.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
CONTROL = "control"  # the named pipe nvidia-cuda-mps-control creates in its pipe directory


@dataclass(frozen=True)
class MpsRoot:
    """Where the MPS control daemon of `k8s/components/mps` keeps its pipe and shared-memory directories."""

    root: Path

    @property
    def pipe_dir(self) -> Path:
        return self.root / "pipe"

    @property
    def shm_dir(self) -> Path:
        return self.root / "shm"

    def running(self) -> bool:
        """Whether the control daemon's pipe is there (it is removed when the daemon exits cleanly)."""
        return (self.pipe_dir / CONTROL).exists()

    def client_env(self) -> dict[str, str]:
        """What a container needs in its environment to reach the daemon."""
        return {PIPE_ENV: str(self.pipe_dir)}


def client_mounts(env: dict[str, str]) -> list[tuple[str, str]]:
    """(host path, container path) a container handed `env` needs: the daemon's pipe directory, and its shared
    memory as the container's `/dev/shm`. None without `CUDA_MPS_PIPE_DIRECTORY`."""
    pipe = env.get(PIPE_ENV)
    if not pipe:
        return []
    return [(pipe, pipe), (str(Path(pipe).parent / "shm"), "/dev/shm")]
