"""The gate's error rates on real held-out learners (issue 60, part 2): how often a gated shadow decides, and how, when
the candidate is as good as the serving version, clearly better, or clearly worse.

    python bench/gate_error_rates.py --data ../shared/data/kt/dkvmn_assist2009_updated [--epochs 5] [--replays 200]
                                     [--work DIR] [--alpha 0.05] [--min-events 100]

1. Three deep_gpcm versions trained with `nextstep train` (configs/deep_gpcm_assistments09.json, --epochs): A on
   every training learner (seed 0), A' the same with seed 1 (equal quality, another seed), and B on every fifth
   training learner (clearly worse). With --work DIR they are kept there and reused by the next run.
2. Every test learner's whole history scored through each version's exported graphs by the service's own code
   (nextstep.scoring.Scorer: `POST /v1/kt/{model}/batch`'s path): each event's prediction from the version's state
   before it, as a gated shadow pairs them; the per-event log loss of each version.
3. Per scenario (serving, candidate): the paired differences, loss(candidate) - loss(serving), per learner; each
   replay puts the learners in a random order and feeds their events one by one to the gate's own arithmetic
   (nextstep.service.gate: the confidence sequence with learner_spread, decide; vectorised here, the same formulas),
   stopping at the first decision. `--iid` uses the events' own spread instead, as if events were independent.
   The shares of replays that
   decided each way, and the median number of events to a decision.

Scenarios: (a) null: A' against A with each learner's differences given a random sign in each replay (which version
is the candidate drawn per learner), so that the mean difference is exactly 0 while the real data's noise and each
learner's correlated events stay: any decision is an error (goal: at most alpha); (a') another seed, A' against A as
they are: equal settings, but not necessarily equal quality on this test file (its mean difference says); (b)
better, A against B serving: promoted (goal: at least 90%); (c) worse, B against A serving: aborted (goal: at least
90%).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from nextstep.scoring import Scorer, ScoringError
from nextstep.service.gate import OPTIMIZED_AT, Evidence, GateConfig, decide, learner_spread, log_losses
from nextstep.service.kt.service import Event

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "deep_gpcm_assistments09.json"


def three_line(path: Path) -> list[list[str]]:
    """The records of a DKVMN three-line file: [count, questions, responses] per learner, as text lines."""
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    return [lines[i:i + 3] for i in range(0, len(lines) - len(lines) % 3, 3)]


def fifth(data: Path, out: Path) -> Path:
    """A copy of the data set whose training file keeps every fifth learner."""
    out.mkdir(parents=True, exist_ok=True)
    for path in data.iterdir():
        if "train" in path.name:
            kept = three_line(path)[::5]
            (out / path.name).write_text("".join("\n".join(r) + "\n" for r in kept))
        elif "valid" not in path.name:
            (out / path.name).write_bytes(path.read_bytes())
    return out


def train(data: Path, out: Path, seed: int, epochs: int) -> Path:
    if not (out / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "nextstep.cli", "train", "deep_gpcm", "--data", str(data), "--out",
                        str(out), "--config", str(CONFIG), "--epochs", str(epochs), "--seed", str(seed), "--quiet"],
                       check=True)
    return out


def losses(artifact: Path, learners: list[tuple[str, list[Event]]]) -> dict[str, np.ndarray]:
    """Each learner's per-event log loss through the version, each event predicted from the state before it."""
    scorer = Scorer.open(artifact)
    out = {}
    try:
        for student, events in learners:
            try:
                scored = scorer.score((student, events, None))
            except ScoringError:
                continue
            probs = np.array([p["probabilities"] for p in scored["event_predictions"]])
            out[student] = log_losses(probs, np.array([e.response for e in events]))
    finally:
        scorer.close()
    return out


def replay(per_learner: list[np.ndarray], config: GateConfig, replays: int, seed: int, flip: bool = False,
           iid: bool = False) -> list[tuple[str, int]]:
    """(the first decision, the events it took; "continue" and the events in all when none) of each replay. With
    `flip`, each learner's differences change sign at random in each replay (which version is the candidate, drawn
    per learner): a mean of exactly 0, each learner's own correlations kept."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(replays):
        order = rng.permutation(len(per_learner))
        signs = rng.choice([-1.0, 1.0], size=len(per_learner)) if flip else np.ones(len(per_learner))
        parts = [signs[i] * per_learner[i] for i in order]
        d = np.concatenate(parts)
        n = np.arange(1, len(d) + 1)
        mean = np.cumsum(d) / n
        # the gate's learner_spread after each event: sums over the learners so far (the current one partly seen)
        lengths = np.array([len(p) for p in parts])
        owner = np.repeat(np.arange(len(parts)), lengths)
        start = np.repeat(np.cumsum(lengths) - lengths, lengths)
        within_s = np.cumsum(d) - np.concatenate([[0.0], np.cumsum(d)])[start]  # the current learner's S so far
        within_n = (n - start).astype(float)
        totals = np.array([p.sum() for p in parts])
        ss_done = np.concatenate([[0.0], np.cumsum(totals ** 2)])[owner]
        ns_done = np.concatenate([[0.0], np.cumsum(lengths * totals)])[owner]
        nn_done = np.concatenate([[0.0], np.cumsum(lengths.astype(float) ** 2)])[owner]
        spread = learner_spread(mean, ss_done + within_s ** 2, ns_done + within_n * within_s,
                                nn_done + within_n ** 2)
        if iid:  # (the paper's: n times the events' variance)
            spread = n * np.maximum(np.cumsum(d * d) / n - mean ** 2, 0)
        alpha = config.alpha
        r2 = (-2 * np.log(alpha) + np.log(1 - 2 * np.log(alpha))) / OPTIMIZED_AT
        inner = np.maximum(spread, 0) * r2 + 1
        radius = np.sqrt(2 * inner / (n ** 2 * r2) * np.log(np.sqrt(inner) / alpha))
        low, high = mean - radius, mean + radius
        ready = (n >= config.min_events) & (owner >= config.min_learners - 1)
        decided = ready & ((high < -config.min_gain) | (low > 0))
        if not decided.any():
            out.append(("continue", len(d)))
            continue
        t = int(np.argmax(decided))
        # (the gate's own decision at that event, from its own arithmetic: the vectorised sums above agree with it)
        out.append((decide(Evidence(t + 1, float(mean[t]), (float(low[t]), float(high[t])), int(owner[t]) + 1),
                           config), t + 1))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a DKVMN three-line data set (e.g. dkvmn_assist2009_updated)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--min-events", type=int, default=100)
    parser.add_argument("--work", help="keep the trained versions here (and reuse them)")
    parser.add_argument("--iid", action="store_true", help="the events' own spread, as if independent (the paper's)")
    parser.add_argument("--json", help="write the results as JSON")
    args = parser.parse_args()
    data = Path(args.data)
    work = Path(args.work or tempfile.mkdtemp(prefix="gate-error-rates-"))
    versions = {"A": train(data, work / "A", 0, args.epochs), "A'": train(data, work / "A2", 1, args.epochs),
                "B": train(fifth(data, work / "fifth"), work / "B", 0, args.epochs)}
    (test,) = [p for p in data.iterdir() if "test" in p.name]
    learners = [(f"test-{i}", [Event(q, int(r)) for q, r in zip(rec[1].split(","), rec[2].split(","), strict=True)
                               if q])
                for i, rec in enumerate(three_line(test))]
    scored = {name: losses(path, learners) for name, path in versions.items()}
    common = sorted(set.intersection(*(set(s) for s in scored.values())))
    config = GateConfig(alpha=args.alpha, min_events=args.min_events)
    results = {"learners": len(common), "events": int(sum(len(scored["A"][s]) for s in common)),
               "mean_log_loss": {k: float(np.concatenate([v[s] for s in common]).mean()) for k, v in scored.items()},
               "scenarios": {}}
    for label, serving, candidate, want in (("null", "A", "A'", None), ("another seed", "A", "A'", None),
                                            ("better", "B", "A", "promote"), ("worse", "A", "B", "abort")):
        diffs = [scored[candidate][s] - scored[serving][s] for s in common]
        got = replay(diffs, config, args.replays, seed=len(label), flip=label == "null", iid=args.iid)
        decisions = [d for d, _ in got]
        to_decide = [t for d, t in got if d != "continue"]
        results["scenarios"][label] = {
            "serving": serving, "candidate": candidate,
            "mean_difference": float(np.concatenate(diffs).mean()),
            "shares": {d: decisions.count(d) / len(got) for d in ("promote", "abort", "continue")},
            "median_events_to_decision": statistics.median(to_decide) if to_decide else None,
            "goal": ("any decision at most alpha" if label == "null" else "as its mean difference says")
            if want is None else f"{want} in at least 90%"}
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
