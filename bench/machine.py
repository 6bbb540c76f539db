"""What the benchmarks print about the machine they ran on (shared by the bench scripts)."""

import contextlib
import os
import platform
from pathlib import Path


def machine() -> dict:
    """CPU model, core counts and the load averages at the time of the call."""
    cpu = platform.processor() or ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        load = None
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "usable_cpus": usable, "load_avg": load,
            "platform": platform.platform()}
