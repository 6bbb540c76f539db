"""Served intervals against FSRS-6's, per user (issue 38 part 4): for each user of a data folder, the user's reviews
replayed through the service, and every card scheduled one minute after its own last review at each desired
retention, next to FSRS-6's interval for the same card under the same user's parameters.

    python bench/srs_intervals.py ARTIFACT --data ../shared/data/srs/anki_more [--retentions 0.9 0.8]
                                  [--max-interval-days 1825] [--users NAME ...] [--json OUT]

Per user (each folder holding one user's data, read as `nextstep train/evaluate --data` reads them):

1. The user's FSRS-6 parameters: `nextstep.training.srs.eval.fit_fsrs6` on all of the user's reviews (the
   evaluation protocol's per-user fit, fsrs-rs).
2. The served path: the app in process (FastAPI TestClient, real HTTP requests into it, the in-process store, ONNX
   Runtime on the artifact's graphs). The user's first review is posted, then the parameters of step 1 are stored
   in the user's header exactly as `nextstep srs refit` stores a fit (SpacedRepetition.write with the refit's
   header; the service's own refit would fit on the reviews it holds, each card's last `card_size` only, so its
   parameters could differ from FSRS-6's side), then the rest of the reviews in time order, each request telling
   the user's day boundary (`day_start_hour_utc`: their data's, as training and the evaluation count days). Right
   after each card's last review, `POST /v1/srs/MODEL/schedule` for that card with `now` = that review + 60 s, at
   each retention. The served interval is `due` minus the card's last review (`max_interval` cards: the maximum;
   `due_now`: the minute).
3. FSRS-6: the card's stability after all of its reviews (fsrs-rs `memory_state` with the user's parameters; the
   same FSRSItem the evaluation builds), and FSRS-6's interval at retention r, fsrs-rs's `next_interval`:
   t = S / f * (r^(-1/w20) - 1), f = 0.9^(-1/w20) - 1 (R(t) = (1 + f t / S)^-w20 = r), in days, unrounded, capped
   at the same maximum interval as the service's.

`--set gap_shrink=true --export-to DIR` first re-exports the artifact with those model settings changed (settings
without weights only, such as `gap_shrink`: the trained weights are loaded as they are, the setting changed on the
model, and the export's parity and monotonicity checks run again, as `nextstep export` runs them) into DIR, which
`nextstep evaluate DIR` can then score, and measures that.

Prints per user: cards, the median ratio served / FSRS-6 at each retention, the share of cards with a ratio above
2 and below 0.5, the median and largest served interval; with --json, all of it as JSON. Not a speed bench: it
states what the schedules are. About 1-3 minutes a user on one core (a schedule request per card and retention).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import tempfile
import time as _time
from dataclasses import replace
from pathlib import Path

import numpy as np
from fastapi.testclient import TestClient

from nextstep.service.app import create_app
from nextstep.service.core import Change
from nextstep.service.settings import Settings
from nextstep.service.srs.stored import Fit, _decode, _encode
from nextstep.training.srs.eval import _CardHistories, fit_fsrs6
from nextstep.training.srs.reviews import ReviewLog, read_users

MODEL = "time_aware"
POST_BATCH = 100


def reexport_with(artifact: Path, out: Path, changes: dict) -> Path:
    """A new artifact at `out` from `artifact`'s weights with model settings that hold no weights changed: the model
    is restored with its own config and weights, the settings set on it, and exported again (parity and the
    monotonicity check as `nextstep export` runs them). A setting that would change the weights' shapes is refused."""
    import torch

    from nextstep.training.export import export, load_weights
    from nextstep.training.families import family, restore
    from nextstep.training.srs.time_aware_export import TimeAwareExporter

    model, manifest = load_weights(artifact, restore)
    for key, value in changes.items():
        if not hasattr(model.cfg, key):
            raise SystemExit(f"--set {key}: {type(model.cfg).__name__} has no such setting")
        setattr(model.cfg, key, value)
    fresh = family(model.family).build(model.cfg.to_dict()).state_dict()
    if {k: v.shape for k, v in fresh.items()} != {k: v.shape for k, v in model.state_dict().items()}:
        raise SystemExit(f"--set {changes}: changes the model's weights; train with it instead")
    with np.load(artifact / manifest["parity"]["inputs"]) as parity:
        sequence = tuple(torch.from_numpy(parity[f"arr_{i}"]) for i in range(len(parity.files)))
    export(TimeAwareExporter.from_artifact(model, artifact, manifest), out, manifest=manifest, sequence=sequence)
    return out


def fsrs6_intervals(w: list[float], stability: np.ndarray, retention: float) -> np.ndarray:
    """FSRS-6's interval in days at a desired retention (fsrs-rs `next_interval`, unrounded): where
    R(t) = (1 + f t / S)^-w20 falls to it, f = 0.9^(-1/w20) - 1."""
    decay = float(w[20])
    factor = 0.9 ** (-1.0 / decay) - 1.0
    return np.asarray(stability, dtype=np.float64) / factor * (retention ** (-1.0 / decay) - 1.0)


def card_stabilities(log: ReviewLog, w: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """(each card's last row in the log, FSRS-6's stability after all of the card's reviews under w), one user."""
    import fsrs_rs_python as fsrs

    card = np.asarray(log.card)
    _, last_rev = np.unique(card[::-1], return_index=True)
    last = np.sort(len(card) - 1 - last_rev)
    hist = _CardHistories(log)
    states = fsrs.FSRS(list(w)).memory_state_batch([hist.item(int(r), True) for r in last])
    return last, np.array([s.stability for s in states], dtype=np.float64)


def _reviews(log: ReviewLog, lo: int, hi: int) -> list[dict]:
    return [{"card_id": str(int(log.card[i])), "deck_id": str(int(log.deck[i])), "time": float(log.time[i]),
             "rating": int(log.rating[i]),
             **({"duration": float(log.duration[i])} if np.isfinite(log.duration[i]) else {})}
            for i in range(lo, hi)]


def _store_parameters(http: TestClient, user: str, w: list[float], fitted_on: int) -> None:
    """Store w as the user's FSRS-6 parameters, as `SpacedRepetition.refit` writes a fit (header only)."""
    srs = http.app.state.srs
    model = srs.model(MODEL, user)
    fit = Fit(tuple(float(x) for x in w), fitted_on, fitted_on, _time.time())

    async def attempt(current, *_):
        h = _decode(current)
        return Change(_encode(h.recent, h.n_cards, h.drift, h.scored, replace(fit, day_start=h.fit.day_start)),
                      _answer)

    async def _answer(_written):
        return {}

    http.portal.call(functools.partial(srs.write, model, srs.key(model, user), f"user {user!r}", [], attempt))


def served_intervals(http: TestClient, user: str, log: ReviewLog, w: list[float], last: np.ndarray,
                     retentions: list[float]) -> dict[float, dict]:
    """{retention: {"days": served interval per card of `last` (in that order), "status": ...}} through the app."""
    out = {r: {"days": np.full(len(last), np.nan), "status": [""] * len(last)} for r in retentions}
    is_last = np.full(len(log), -1)
    is_last[last] = np.arange(len(last))
    done = 0
    hour = log.day_start_hours().get(log.user_ids[0])
    told = {} if hour is None else {"day_start_hour_utc": hour}  # the user's days, as their data count them

    def post(hi: int) -> None:
        nonlocal done
        for lo in range(done, hi, POST_BATCH):
            reply = http.post(f"/v1/srs/{MODEL}/reviews",
                              json={"user_id": user, "reviews": _reviews(log, lo, min(hi, lo + POST_BATCH)), **told})
            reply.raise_for_status()
        done = max(done, hi)

    post(1)
    _store_parameters(http, user, w, len(log))
    got = http.get(f"/v1/srs/{MODEL}/users/{user}").json()["parameters"]["w"]
    if not np.allclose(got, w, rtol=1e-6, atol=1e-6):
        raise RuntimeError(f"{user}: the stored parameters are not the fitted ones")
    for i in range(len(log)):
        k = is_last[i]
        if k < 0:
            continue
        post(i + 1)
        t = float(log.time[i])
        for r in retentions:
            reply = http.post(f"/v1/srs/{MODEL}/schedule", json={
                "user_id": user, "now": t + 60.0, "desired_retention": r,
                "cards": [{"card_id": str(int(log.card[i])), "deck_id": str(int(log.deck[i]))}]})
            reply.raise_for_status()
            card = reply.json()["cards"][0]
            out[r]["days"][k] = (card["due"] - t) / 86400.0
            out[r]["status"][k] = card["status"]
    post(len(log))
    return out


def measure_user(http: TestClient, name: str, log: ReviewLog, retentions: list[float], max_days: float) -> dict:
    t0 = _time.perf_counter()
    w = fit_fsrs6(log, np.arange(len(log), dtype=np.int64))
    last, stability = card_stabilities(log, w)
    served = served_intervals(http, name, log, w, last, retentions)
    user: dict = {"user": name, "reviews": len(log), "cards": int(len(last)), "w": [float(x) for x in w]}
    for r in retentions:
        fsrs_days = np.minimum(fsrs6_intervals(w, stability, r), max_days)
        days = served[r]["days"]
        ratio = days / fsrs_days
        status, counts = np.unique(served[r]["status"], return_counts=True)
        user[str(r)] = {
            "median_ratio": float(np.median(ratio)), "share_above_2": float(np.mean(ratio > 2)),
            "share_below_0.5": float(np.mean(ratio < 0.5)),
            "ratio_quartiles": [float(q) for q in np.quantile(ratio, [0.25, 0.75])],
            "median_days": float(np.median(days)), "max_days": float(days.max()),
            "fsrs6_median_days": float(np.median(fsrs_days)), "fsrs6_max_days": float(fsrs_days.max()),
            "status": {str(s): int(c) for s, c in zip(status, counts, strict=True)},
        }
    user["seconds"] = round(_time.perf_counter() - t0, 1)
    return user


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path, help="an exported time_aware version directory")
    parser.add_argument("--data", required=True, help="a folder of users' folders (or one user's), as --data reads")
    parser.add_argument("--retentions", type=float, nargs="+", default=[0.9, 0.8])
    parser.add_argument("--max-interval-days", type=int, default=1825,
                        help="NEXTSTEP_SRS_MAX_INTERVAL_DAYS for the service; FSRS-6's intervals get the same cap")
    parser.add_argument("--users", nargs="+", help="only these users (names as read_users gives them)")
    parser.add_argument("--json", metavar="OUT", help="also write the results as JSON")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=JSON",
                        help="model settings without weights to change first (e.g. gap_shrink=true); needs --export-to")
    parser.add_argument("--export-to", type=Path, help="where the re-exported artifact goes (a new directory)")
    args = parser.parse_args(argv)
    if args.set:
        if args.export_to is None:
            raise SystemExit("--set needs --export-to")
        changes = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
        args.artifact = reexport_with(args.artifact, args.export_to, changes)
    users = [(n, log) for n, log in read_users(args.data) if not args.users or n in args.users]
    root = Path(tempfile.mkdtemp())
    try:
        shutil.copytree(args.artifact, root / MODEL / "1")
        settings = Settings(artifacts_dir=root, srs_max_interval_days=args.max_interval_days, live_quality=False)
        results = []
        with TestClient(create_app(settings)) as http:
            for name, log in users:
                res = measure_user(http, name, log, args.retentions, float(args.max_interval_days))
                results.append(res)
                cells = "  ".join(f"r={r}: median {c['median_ratio']:.2f}, >2 {c['share_above_2']:.0%}, <0.5 "
                                  f"{c['share_below_0.5']:.0%}, max {c['max_days']:.0f} d"
                                  for r, c in ((r, res[str(r)]) for r in args.retentions))
                print(f"{name}: {res['cards']} cards  {cells}  ({res['seconds']:.0f} s)", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = {"artifact": str(args.artifact), "set": args.set, "data": args.data, "retentions": args.retentions,
              "max_interval_days": args.max_interval_days, "users": results}
    inside = [all(0.5 <= u[str(r)]["median_ratio"] <= 2 for r in args.retentions) for u in results]
    print(f"users with every median ratio in [0.5, 2]: {sum(inside)} of {len(results)}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
