"""The tables of bench/srs_user_folds.sh: per held-out user, the log loss and intervals of the network trained on the
other twelve users (the default rules, "on", and the network's own curve, "off"), next to FSRS-6 fitted per user
and with its defaults.

    python bench/srs_user_folds.py runs/user_folds                  # one run: its tables
    python bench/srs_user_folds.py runs/user_folds_s0 runs/user_folds_s1 runs/user_folds_s2
                                                                    # several seeds: each seed's summary, then each
                                                                    # user's log loss over the seeds and the goals
                                                                    # on the mean over seeds
    EVAL=mix_on.json python bench/srs_user_folds.py runs/ep_s0 ...  # each fold's scores with the mixture at the
                                                                    # defaults, replayed (bench/srs_mixture_choice.py)
"""

from __future__ import annotations

import json
import os
import statistics as st
import sys
from pathlib import Path

EVAL = os.environ.get("EVAL", "eval_on.json")  # each fold's scores (the default rules)


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


def over_seeds(outs: list[Path]) -> None:
    runs = [users(out, EVAL) for out in outs]
    for out, rows in zip(outs, runs, strict=True):
        print(f"{out.name}: {summary(rows)}\n")
    by_user: dict[str, list[dict]] = {}
    for rows in runs:
        for _, u in rows:
            by_user.setdefault(u["user"], []).append(u)
    print(f"| user (never trained on) | scored | log loss, seeds {' / '.join(o.name for o in outs)} | mean | "
          "FSRS-6 per user | FSRS-6 default | model / FSRS-6 - 1 |")
    print("|---|---|---|---|---|---|---|")
    mean_rows = []
    for name, us in by_user.items():
        ll = [u["log_loss"] for u in us]
        first = us[0]
        mean_rows.append((0, {**first, "log_loss": st.mean(ll), "rmse_bins": st.mean(u["rmse_bins"] for u in us),
                              "auc": st.mean(u["auc"] for u in us),
                              "duration_mae_s": st.mean(u["duration_mae_s"] for u in us)}))
        print(f"| {name} | {first['scored']} | {' / '.join(f'{x:.4f}' for x in ll)} | {st.mean(ll):.4f} | "
              f"{first['fsrs6']['log_loss']:.4f} | {first['fsrs6_default']['log_loss']:.4f} | "
              f"{st.mean(ll) / first['fsrs6']['log_loss'] - 1:+.1%} |")
    rel = [st.mean(u["log_loss"] / u["fsrs6"]["log_loss"] - 1 for _, u in rows) for rows in runs]
    print(f"\nmean of per-user (model / FSRS-6 - 1) per seed: {', '.join(f'{r:+.1%}' for r in rel)} "
          f"(mean {st.mean(rel):+.1%})\n\neach user's mean over the seeds: {summary(mean_rows)}")


def main(out: Path) -> None:
    on, off = users(out, EVAL), users(out, "eval_off.json")
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
    print(f"\ndefault rules (on): {summary(on)}\n")
    if off:
        print(f"network's own curve (off): {summary(off)}\n")
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
    dirs = [Path(a) for a in sys.argv[1:]] or [Path("runs/user_folds")]
    main(dirs[0]) if len(dirs) == 1 else over_seeds(dirs)
