"""The CPUs this process may use, and the thread settings that follow from them (`nextstep` commands that train,
evaluate, export or score).

Torch's OpenMP pool has as many threads as the machine has cores, and by default an idle thread spins for a while
before it sleeps: on a machine shared with other work (other trainings, a CPU quota smaller than the machine) the
spinning threads take turns from the ones with work, and an epoch took 25 times as long for 3 times too many
threads (issue 58). So each command sizes the pool by the CPUs it may use (its affinity, and a cgroup's CPU quota,
where a container sets one) and lets idle threads sleep at once (OMP_WAIT_POLICY=PASSIVE). Each is a default: a
variable the user set wins. bench/training_threads.py measures an epoch alone and beside two other trainings.
"""

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")


def _quota(root: Path = CGROUP) -> float | None:
    """CPUs a cgroup's quota allows this process (cgroup v2 cpu.max, or v1 cpu.cfs_quota_us / cfs_period_us), None
    without a quota."""
    try:
        limit, period = (root / "cpu.max").read_text().split()
        return None if limit == "max" else int(limit) / int(period)
    except (OSError, ValueError):
        pass
    try:
        limit = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if limit <= 0 or period <= 0 else limit / period
    except (OSError, ValueError):
        return None


def usable_cpus(root: Path = CGROUP) -> int:
    """The CPUs this process may use: its affinity, at most the whole CPUs of its cgroup's quota; at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        n = os.cpu_count() or 1
    quota = _quota(root)
    return max(1, min(n, math.floor(quota)) if quota is not None else n)


def configure_threads(environ: dict = os.environ) -> dict[str, str]:
    """Before torch is imported: OMP_NUM_THREADS from `usable_cpus` and OMP_WAIT_POLICY=PASSIVE, unless set.
    Returns what it set."""
    wanted = {"OMP_NUM_THREADS": str(usable_cpus()), "OMP_WAIT_POLICY": "PASSIVE"}
    chosen = {name: value for name, value in wanted.items() if name not in environ}
    environ.update(chosen)
    return chosen
