"""The tables of bench/srs_user_folds.sh: per held-out user, the log loss and intervals of the network trained on the
other twelve users (gap_shrink on, the default, and off), next to FSRS-6 fitted per user and with its defaults.

    python bench/srs_user_folds.py runs/user_folds
"""

from __future__ import annotations

import json
import statistics as st
import sys
from pathlib import Path


def users(out: Path, name: str) -> list[tuple[int, dict]]:
    rows = []
    for k in (1, 2, 3, 4):
        path = out / f"f{k}" / name
        if path.exists():
            rows += [(k, u) for u in json.loads(path.read_text())["users"]]
    return rows


def summary(rows: list[tuple[int, dict]]) -> str:
    us = [u for _, u in rows]

    def mean(f) -> float:
        return st.mean(f(u) for u in us)

    rel = mean(lambda u: u["log_loss"] / u["fsrs6"]["log_loss"] - 1)
    rel_default = mean(lambda u: u["log_loss"] / u["fsrs6_default"]["log_loss"] - 1)
    worse = [u["user"] for u in us if u["log_loss"] > u["fsrs6_default"]["log_loss"]]
    below = sum(u["duration_mae_s"] < u["median_duration_mae_s"] for u in us)
    return (f"{len(us)} users: mean log loss {mean(lambda u: u['log_loss']):.4f}, FSRS-6 per user "
            f"{mean(lambda u: u['fsrs6']['log_loss']):.4f}, "
            f"FSRS-6 default {mean(lambda u: u['fsrs6_default']['log_loss']):.4f}; "
            f"mean of per-user (model / FSRS-6 - 1) {rel:+.1%}, against the defaults {rel_default:+.1%}; "
            f"RMSE(bins) {mean(lambda u: u['rmse_bins']):.4f} against {mean(lambda u: u['fsrs6']['rmse_bins']):.4f}; "
            f"AUC {mean(lambda u: u['auc']):.3f} against {mean(lambda u: u['fsrs6']['auc']):.3f}; "
            f"answer-time MAE {mean(lambda u: u['duration_mae_s']):.2f} s against the user's median "
            f"{mean(lambda u: u['median_duration_mae_s']):.2f} s (below on {below} of {len(us)}); "
            f"worse than FSRS-6 default: {', '.join(worse) or 'none'}")


def main(out: Path) -> None:
    on, off = users(out, "eval_on.json"), users(out, "eval_off.json")
    off_by = {u["user"]: u for _, u in off}
    print("| fold | user (never trained on) | scored | log loss: on / off | FSRS-6 per user | FSRS-6 default | "
          "RMSE(bins) on / FSRS-6 | AUC on / FSRS-6 | answer-time MAE s (on / user's median) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for k, u in on:
        o = off_by.get(u["user"], {}).get("log_loss", float("nan"))
        print(f"| {k} | {u['user']} | {u['scored']} | {u['log_loss']:.4f} / {o:.4f} | {u['fsrs6']['log_loss']:.4f} | "
              f"{u['fsrs6_default']['log_loss']:.4f} | {u['rmse_bins']:.4f} / {u['fsrs6']['rmse_bins']:.4f} | "
              f"{u['auc']:.3f} / {u['fsrs6']['auc']:.3f} | "
              f"{u['duration_mae_s']:.2f} / {u['median_duration_mae_s']:.2f} |")
    print(f"\ngap_shrink on (default): {summary(on)}\n\ngap_shrink off: {summary(off)}\n")
    ratios: dict[str, dict[str, tuple]] = {}
    for setting in ("on", "off"):
        for k, u in users(out, f"int_{setting}.json"):
            ratios.setdefault(u["user"], {"fold": k, "cards": u["cards"]})[setting] = (
                u["0.9"]["median_ratio"], u["0.8"]["median_ratio"])
    print("| fold | user | cards | median ratio served / FSRS-6 at 0.9 / 0.8: on | off |")
    print("|---|---|---|---|---|")
    inside = {"on": 0, "off": 0}
    for user, r in ratios.items():
        cells = []
        for setting in ("on", "off"):
            a, b = r.get(setting, (float("nan"), float("nan")))
            ok = 0.5 <= a <= 2 and 0.5 <= b <= 2
            inside[setting] += ok
            cells.append(f"{a:.2f} / {b:.2f}" if ok else f"**{a:.2f} / {b:.2f}**")
        print(f"| {r['fold']} | {user} | {r['cards']} | {cells[0]} | {cells[1]} |")
    print(f"\nusers with both medians in [0.5, 2]: on {inside['on']} of {len(ratios)}, off {inside['off']} of "
          f"{len(ratios)}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/user_folds"))
