"""The evaluation report of a run: metrics.json and PNG plots (learning curves, confusion, calibration)."""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ..metrics import calibration_curve, confusion_matrix  # noqa: E402


def write_report(out_dir: Path, metrics: dict, history: list[dict], test_probs: np.ndarray,
                 test_targets: np.ndarray) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics.json").write_text(json.dumps({**metrics, "history": history}, indent=2))
    _learning_curves(out_dir / "learning_curves.png", history)
    _confusion(out_dir / "confusion_matrix.png", test_probs, test_targets)
    _calibration(out_dir / "calibration.png", test_probs, test_targets)


def _learning_curves(path: Path, history: list[dict]) -> None:
    epochs = [h["epoch"] for h in history]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(epochs, [h.get("train_loss", np.nan) for h in history], label="train loss")  # none at epoch 0
    left.plot(epochs, [h["valid_nll"] for h in history], label="validation NLL")
    left.set_xlabel("epoch")
    left.legend()
    for key in ("valid_categorical_accuracy", "valid_qwk", "valid_auc"):
        if key in history[0]:
            right.plot(epochs, [h[key] for h in history], label=key.removeprefix("valid_"))
    right.set_xlabel("epoch")
    right.set_title("validation")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _confusion(path: Path, probs: np.ndarray, targets: np.ndarray) -> None:
    K = probs.shape[1]
    cm = confusion_matrix(targets, probs.argmax(1), K).astype(float)
    rows = cm / np.maximum(cm.sum(1, keepdims=True), 1)
    fig, ax = plt.subplots(figsize=(4 + 0.4 * K, 3.5 + 0.4 * K))
    ax.imshow(rows, cmap="Blues", vmin=0, vmax=1)
    for i in range(K):
        for j in range(K):
            ax.text(j, i, f"{int(cm[i, j])}\n{rows[i, j]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xlabel("predicted (argmax)")
    ax.set_ylabel("observed")
    ax.set_xticks(range(K))
    ax.set_yticks(range(K))
    ax.set_title("test confusion (row-normalised)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _calibration(path: Path, probs: np.ndarray, targets: np.ndarray) -> None:
    predicted, observed, counts = calibration_curve(probs, targets, n_bins=10)
    keep = counts > 0
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1)
    ax.plot(predicted[keep], observed[keep], marker="o")
    ax.set_xlabel("predicted probability")
    ax.set_ylabel("observed frequency")
    ax.set_title("test calibration (all categories)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
