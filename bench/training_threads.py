"""Training on a shared machine (issue 58, part 4): deep_gpcm's epoch speed alone and beside two other trainings,
with the thread settings of the libraries (torch's OpenMP pool of every core, idle threads spinning before they
sleep) and with nextstep's (nextstep/cpus.py: a pool of the CPUs the process may use, idle threads sleeping at once).

    python bench/training_threads.py [--data ../shared/data/kt/deepgpcm_synthetic_500_200_4] [--epochs 2]
                                     [--crowd 3] [--json OUT]

Each run is `nextstep train deep_gpcm` stopped once it has printed its last epoch (no export); its speed is that
epoch's targets/s (the first epochs warm up). "library" runs the command's function without nextstep's settings
(`args.func`), "nextstep" through `main` (OMP_NUM_THREADS from the usable CPUs, OMP_WAIT_POLICY=PASSIVE). The goal:
beside two others, each training runs at least at the share of the CPU it gets, a third of its speed alone.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import machine

ROOT = Path(__file__).resolve().parents[1]
RUN = {  # how each policy runs the command: through main (nextstep's settings), or its function alone
    "nextstep": "import sys; from nextstep.cli import main; sys.exit(main(sys.argv[1:]))",
    "library": "import sys; from nextstep.cli import build_parser; a = build_parser().parse_args(sys.argv[1:]); "
               "sys.exit(a.func(a))",
}
EPOCH = re.compile(r"^epoch\s+(\d+)\s.*\s(\d+) targets/s")


def start(policy: str, data: str, out: Path, epochs: int) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    return subprocess.Popen([sys.executable, "-c", RUN[policy], "train", "deep_gpcm", "--data", data, "--out",
                             str(out), "--epochs", str(epochs), "--quiet"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def last_epoch(proc: subprocess.Popen, epochs: int) -> float:
    """The targets/s of the run's last epoch; the run is stopped then (its export is not timed)."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        found = EPOCH.match(line.strip())
        if found and int(found.group(1)) == epochs:
            proc.kill()
            proc.wait()
            return float(found.group(2))
    proc.wait()
    raise RuntimeError("the training ended without its epoch line:\n" + "".join(lines[-20:]))


def measure(policy: str, data: str, epochs: int, crowd: int, work: Path) -> dict:
    alone = last_epoch(start(policy, data, work / f"{policy}-alone", epochs), epochs)
    started = time.monotonic()
    procs = [start(policy, data, work / f"{policy}-crowd-{i}", epochs) for i in range(crowd)]
    speeds = [last_epoch(p, epochs) for p in procs]
    return {"alone_targets_per_second": alone, "crowd_targets_per_second": speeds,
            "crowd_seconds": round(time.monotonic() - started, 1),
            "crowd_vs_share": min(speeds) / (alone / crowd)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(ROOT.parent / "shared/data/kt/deepgpcm_synthetic_500_200_4"))
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--crowd", type=int, default=3, help="trainings at once (default 3)")
    parser.add_argument("--policies", nargs="+", default=["library", "nextstep", "nextstep", "library"])
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    out = {"machine": machine(), "runs": []}
    with tempfile.TemporaryDirectory() as work:
        for policy in args.policies:
            got = measure(policy, args.data, args.epochs, args.crowd, Path(work))
            out["runs"].append({"policy": policy, **got})
            print(f"{policy:9s} alone {got['alone_targets_per_second']:8.0f} targets/s; {args.crowd} at once: "
                  f"{', '.join(f'{s:.0f}' for s in got['crowd_targets_per_second'])} targets/s "
                  f"({got['crowd_seconds']} s); slowest / (alone / {args.crowd}) = {got['crowd_vs_share']:.2f}",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
