"""A flashcard model used as a user would (issue 15's check): served in-process, fed a user's first reviews
through `/reviews`, then `/predict` for the most recently reviewed cards at 1 hour ... 365 days after their
last review, and `/schedule` for the same cards at falling desired retentions.

    python bench/srs_curves.py ARTIFACT [--data ../shared/data/srs/ankimath] [--reviews 3000] [--cards 60]

Prints how many curves rise again anywhere, a typical curve, how many cards get a shorter interval at a lower
retention, and the median interval per retention. Not a speed bench: it states what the outputs mean.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import numpy as np
from fastapi.testclient import TestClient

from nextstep.service.app import create_app
from nextstep.service.settings import Settings
from nextstep.training.srs.reviews import read_reviews

DAYS = [1 / 24, 0.25, 1, 3, 7, 14, 30, 90, 180, 365]
RETENTIONS = [0.97, 0.95, 0.9, 0.85, 0.8, 0.7]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path, help="an exported time_aware version directory")
    parser.add_argument("--data", default="../shared/data/srs/ankimath")
    parser.add_argument("--duration-cap-s", type=float, default=500.0)
    parser.add_argument("--reviews", type=int, default=3000)
    parser.add_argument("--cards", type=int, default=60)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    shutil.copytree(args.artifact, root / "time_aware" / "1")
    log = read_reviews(args.data, duration_cap_s=args.duration_cap_s)
    n = min(args.reviews, len(log))
    reviews = [{"card_id": str(int(log.card[i])), "deck_id": str(int(log.deck[i])), "time": float(log.time[i]),
                "rating": int(log.rating[i]),
                **({"duration": float(log.duration[i])} if np.isfinite(log.duration[i]) else {})} for i in range(n)]
    with TestClient(create_app(Settings(artifacts_dir=root))) as http:
        for lo in range(0, n, 100):
            reply = http.post("/v1/srs/time_aware/reviews", json={"user_id": "u", "reviews": reviews[lo:lo + 100]})
            reply.raise_for_status()
        last = {r["card_id"]: r for r in reviews}
        cards = sorted(last.values(), key=lambda r: -r["time"])[:args.cards]
        now = reviews[-1]["time"] + 60
        rises, example = 0, None
        for c in cards:
            curve = [http.post("/v1/srs/time_aware/predict", json={
                "user_id": "u", "card_id": c["card_id"], "deck_id": c["deck_id"], "time": c["time"] + d * 86400,
            }).json()["p_recall"] for d in DAYS]
            rises += int(np.any(np.diff(curve) > 1e-6))
            example = example or [round(p, 3) for p in curve]
        print(f"curves that rise again between 1 hour and 365 days: {rises} of {len(cards)}; a typical one: {example}")
        due = {}
        for retention in RETENTIONS:
            reply = http.post("/v1/srs/time_aware/schedule", json={
                "user_id": "u", "now": now, "desired_retention": retention,
                "cards": [{"card_id": c["card_id"], "deck_id": c["deck_id"]} for c in cards]})
            reply.raise_for_status()
            due[retention] = [(d["due"] - now) / 86400 for d in reply.json()["cards"]]
        shorter = sum(any(due[a][i] > due[b][i] + 1e-6 for a, b in zip(RETENTIONS, RETENTIONS[1:], strict=False))
                      for i in range(len(cards)))
        longer = sum(due[RETENTIONS[-1]][i] > due[RETENTIONS[0]][i] for i in range(len(cards)))
        print(f"cards with a shorter interval at a lower retention: {shorter}; longer at {RETENTIONS[-1]} than at "
              f"{RETENTIONS[0]}: {longer} of {len(cards)}")
        print("median interval (days) by retention:", {r: round(float(np.median(v)), 1) for r, v in due.items()})


if __name__ == "__main__":
    main()
