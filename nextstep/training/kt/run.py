"""One training run end to end: read a data set directory, train, evaluate on its test file, export.

    train file --split by student--> fit + validation (early stopping, tuning)
    test file  --------------------> metrics.test (never used to choose anything)
"""

import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ..data import Vocabulary, fingerprint, hide_ids, unknown_record
from ..export import load_weights
from ..families import family, restore
from ..metrics import BINARY_ONLY, ORDINAL_ONLY
from .data import KTDataset, split_students
from .export import export_artifact
from .loop import Encoded, TrainConfig, fit, predict_sequences
from .report import write_report

TASK = "knowledge_tracing"


def say(line: str) -> None:
    """A line of the run's log, at once (also in a log file)."""
    print(line, flush=True)


def encode(ds: KTDataset, vocab: Vocabulary) -> list[Encoded]:
    return [(vocab.encode(s.questions), s.responses) for s in ds.sequences]


def irt_recovery(model, vocab: Vocabulary, truth_file: Path, test_pred: dict) -> dict:
    """Spearman correlations of learned item parameters with the generating ones (synthetic data)."""
    from scipy.stats import spearmanr

    truth = json.loads(truth_file.read_text())["question_params"]
    true_beta = np.asarray(truth["difficulties"]["beta"], dtype=float)  # (Q, K-1)
    true_alpha = np.asarray(truth["discrimination"]["alpha"], dtype=float)
    with torch.no_grad():
        rows = torch.arange(2, len(vocab))
        beta = model.head.thresholds(model.question_embed(rows)).numpy()  # depends on the item alone
    ids = np.asarray(vocab.ids)
    keep = (ids >= 0) & (ids < len(true_beta))
    # alpha also sees the learner's state: average it over the item's test predictions
    alpha = np.array([test_pred["alpha"][test_pred["questions"] == i + 2].mean() for i in range(len(ids))])
    has_alpha = keep & ~np.isnan(alpha)
    return {
        "beta_mean_spearman": float(spearmanr(beta[keep].mean(1), true_beta[ids[keep]].mean(1))[0]),
        "beta_per_threshold_spearman": [float(spearmanr(beta[keep][:, j], true_beta[ids[keep]][:, j])[0])
                                        for j in range(true_beta.shape[1])],
        "alpha_spearman": float(spearmanr(alpha[has_alpha], true_alpha[ids[has_alpha]])[0]),
        "n_items": int(keep.sum()),
    }


def train_model(entry, data_dir: str | Path, out_dir: str | Path, *, cfg: TrainConfig,
                fmt: str | None = None, progress: bool = True, log: bool = True) -> dict:
    """The run of the knowledge-tracing families: `entry` is the family's registry entry (or its name)."""
    entry = family(entry)
    if entry.task != TASK:
        raise ValueError(f"{entry.name} is a {entry.task} model, not a {TASK} one")
    read, batcher, loss, score = entry.parts()
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    started = time.perf_counter()
    train_ds, test_ds = read(data_dir, fmt)
    if log:
        say(describe_data(train_ds, test_ds))
    unmeasured = ORDINAL_ONLY if train_ds.n_cats == 2 else BINARY_ONLY
    if cfg.monitor in unmeasured:  # found before training, not as a KeyError after its first epoch
        raise ValueError(f"monitor {cfg.monitor!r} is not measured on data with {train_ds.n_cats} response "
                         f"categories ({train_ds.path}); choose another")
    fit_ds, valid_ds = split_students(train_ds, cfg.valid_fraction, cfg.seed)
    if not len(fit_ds) or not len(valid_ds):
        raise ValueError(too_few_learners(train_ds, cfg.valid_fraction))
    # ids seen only by validation or test students map to the unknown row, as they would in serving; so do ids the
    # fitting students answered fewer than min_question_count times, and a seeded unknown_share of the fitting
    # interactions: through them the unknown row learns an average question, which answers questions added later
    fit_questions = np.concatenate([s.questions for s in fit_ds.sequences])
    vocab = Vocabulary.build(fit_questions, min_count=cfg.min_question_count)
    fit_enc = encode(fit_ds, vocab)
    fit_enc = list(zip(hide_ids([q for q, _ in fit_enc], cfg.unknown_share, cfg.seed), [r for _, r in fit_enc],
                       strict=True))
    unknown = unknown_record(len(vocab.ids), len(np.unique(fit_questions)), cfg.min_question_count,
                             cfg.unknown_share, [q for q, _ in fit_enc])
    if log:
        say(f"unknown row: {unknown['rare_ids']} questions seen fewer than {cfg.min_question_count} times share it; "
            f"{unknown['interactions']} fitting interactions go through it")
    torch.manual_seed(cfg.seed)
    model = entry.build({"n_questions": len(vocab), "n_cats": train_ds.n_cats, **cfg.model})
    if log:
        for line in describe_model(model, len(vocab.ids), cfg.min_question_count):
            say(line)
    # a model may start from what the fitting students alone say (Deep-GPCM: item parameters of a fitted IRT model)
    warm_start = getattr(model, "warm_start", None)
    if warm_start is not None and log and getattr(model.cfg, "irt_init", False):  # it takes up to a minute
        say(f"warm start: fitting a GPCM to the {len(fit_ds)} fitting students' answers for the item parameters")
    warm_started = time.perf_counter()
    warm = warm_start(fit_enc) if warm_start is not None else None
    if warm and log:
        say(f"warm start: done in {time.perf_counter() - warm_started:.1f} s")
    out_dir.mkdir(parents=True, exist_ok=True)
    history = fit(model, fit_enc, encode(valid_ds, vocab), cfg, batcher=batcher, loss=loss,
                  metrics=score, checkpoint=out_dir / "checkpoint.pt", progress=progress, log=log,
                  validate_start=warm is not None)
    train_seconds = time.perf_counter() - started

    test_enc = encode(test_ds, vocab)
    test_pred = predict_sequences(model, test_enc, max_len=cfg.eval_max_len, batcher=batcher)
    best_epoch = [h for h in history if h["best"]][-1]  # the epoch whose weights fit() kept (0: the warm start)
    metrics = {"test": {**score(test_pred["probs"], test_pred["targets"]), **unknown_share(test_enc)},
               "valid": {k.removeprefix("valid_"): v for k, v in best_epoch.items() if k.startswith("valid_")},
               "baseline": base_rate(fit_ds, test_pred["targets"], score)}
    truth = data_dir / "true_irt_parameters.json"
    if truth.exists() and "theta" in test_pred and vocab.numeric:  # IRT outputs; the truth's item ids are integers
        metrics["irt_recovery"] = irt_recovery(model, vocab, truth, test_pred)
    write_report(out_dir / "report", metrics, history, test_pred["probs"], test_pred["targets"])

    parity_q, parity_r = _parity_batch(test_enc, length=max(40, 2 * getattr(model.cfg, "window", 0) + 1))
    manifest = {
        "name": entry.name,
        "version": time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()),
        "task": TASK,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "data": {"dir": str(data_dir), "format": train_ds.fmt, "train_file": train_ds.path,
                 "test_file": test_ds.path, "fingerprint": fingerprint(train_ds.path, test_ds.path),
                 "n_train_students": len(fit_ds), "n_valid_students": len(valid_ds),
                 "n_test_students": len(test_ds), "n_cats": train_ds.n_cats, **data_notes(train_ds, test_ds)},
        "responses": {"n_cats": train_ds.n_cats},
        "unknown": unknown,
        "metrics": metrics,
        "train_config": asdict(cfg),
        "training": {"epochs_run": sum(h["epoch"] > 0 for h in history), "best_epoch": best_epoch["epoch"],
                     "seconds": round(train_seconds, 1), "torch": torch.__version__,
                     **({"warm_start": warm} if warm else {})},
        "report": "report/",
    }
    manifest = export_artifact(model, out_dir, manifest=manifest, vocab_json=vocab.to_json(),
                               parity_questions=parity_q, parity_responses=parity_r)
    (out_dir / "checkpoint.pt").unlink(missing_ok=True)  # weights.pt holds the best weights
    return manifest


def base_rate(fit: KTDataset, targets: np.ndarray, score) -> dict:
    """The test metrics (`score`, the family's) of one prediction for every answer: the fitting learners' shares of
    each response (counts + 1, so that no response has probability 0). The figure a model must beat, next to its
    own in the manifest's `metrics.baseline` and the line `train` ends with."""
    counts = np.bincount(np.concatenate([s.responses for s in fit.sequences]), minlength=fit.n_cats) + 1.0
    return {"name": "base rate", **score(np.broadcast_to(counts / counts.sum(), (len(targets), fit.n_cats)), targets)}


def too_few_learners(train: KTDataset, valid_fraction: float) -> str:
    """Why the training learners leave none to fit or none to validate on (`split_students` holds out at least one
    of two), and what to do."""
    n = len({s.student_id for s in train.sequences})
    if n < 2:
        return (f"{train.path}: {n} training learner, and training needs at least 2: one to fit, one to validate on "
                "for early stopping; give more learners")
    return (f"{train.path}: valid_fraction {valid_fraction} of its {n} training learners leaves none to fit; give a "
            "smaller valid_fraction in --config")


def data_notes(train: KTDataset, test: KTDataset) -> dict:
    """How the data was read, beyond its format (the manifest's `data` holds them): the long format's columns,
    replays dropped, gzip, a one-file split. Empty for a plain three-line, pykt or DTransformer data set."""
    notes = {**test.notes, **train.notes}
    replays = train.notes.get("replays_dropped", 0) + test.notes.get("replays_dropped", 0)
    if replays:
        notes["replays_dropped"] = replays
    if "gzip" in (train.notes.get("compression"), test.notes.get("compression")):
        notes["compression"] = "gzip"
    return notes


def describe_data(train: KTDataset, test: KTDataset) -> str:
    """The log's line on the data: the files, the format they were read as, and how."""
    notes = data_notes(train, test)
    files = train.path if train.path == test.path else f"{train.path} and {test.path}"
    line = (f"data: {files} read as {train.fmt}{' (gzip)' if 'compression' in notes else ''}: {len(train)} "
            f"training and {len(test)} test sequences, {train.n_interactions + test.n_interactions} interactions, "
            f"K = {train.n_cats}")
    if "columns" in notes:
        line += "; columns " + ", ".join(f"{role} {name!r}" for role, name in notes["columns"].items())
    if "replays_dropped" in notes:
        line += f"; {notes['replays_dropped']} rows dropped as replays of an event id"
    if "split" in notes:
        line += f"; {notes['split']}"
    return line


LARGE_VOCABULARY = 100_000  # questions with a row of their own past which the log says why training is slow


def describe_model(model: torch.nn.Module, n_questions: int, min_count: int) -> list[str]:
    """The log's lines on the model's size: its parameters and the memory they take, and, past LARGE_VOCABULARY
    questions with a row of their own, why each step is slow and what makes it faster. (Every training step
    updates every question's rows, as Adam updates every parameter: a million questions cost seconds a step.)"""
    n = sum(p.numel() for p in model.parameters())
    size = n * next(model.parameters()).element_size()
    lines = [f"model: {n:,} parameters ({_bytes(size)}; about {_bytes(4 * size)} in training, with their gradients "
             f"and Adam's moments); {n_questions:,} questions have a row of their own"]
    if n_questions > LARGE_VOCABULARY:
        lines.append(f"warning: {n_questions:,} questions with a row of their own: every training step updates all "
                     f"of them, so a step takes time in proportion to their number; a larger min_question_count in "
                     f"--config (now {min_count}) gives the rarer questions the shared unknown row")
    return lines


def _bytes(n: int) -> str:
    for unit, size in (("GB", 2**30), ("MB", 2**20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 2**10:.1f} KB"


def _parity_batch(seqs: list[Encoded], length: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out sequences cut to `length` (long enough to wrap the attention window) for the export parity
    check; sequences shorter than that are extended by repeating themselves."""
    chosen = sorted(seqs, key=lambda s: -len(s[0]))[:n]
    q = torch.from_numpy(np.stack([np.resize(s[0], length) for s in chosen]))
    r = torch.from_numpy(np.stack([np.resize(s[1], length) for s in chosen]))
    return q, r


def load_model(artifact_dir: str | Path) -> tuple[torch.nn.Module, Vocabulary, dict]:
    """The PyTorch model, vocabulary and manifest of an exported artifact."""
    artifact_dir = Path(artifact_dir)
    model, manifest = load_weights(artifact_dir, restore)
    vocab = Vocabulary.from_json(json.loads((artifact_dir / manifest["vocabularies"]["questions"]).read_text()))
    return model, vocab, manifest


def evaluate_artifact(artifact_dir: str | Path, data_dir: str | Path, fmt: str | None = None,
                      max_len: int | None = None) -> dict:
    """Re-measure an artifact on the test file of a data set directory.

    max_len: cut test sequences into chunks that each start from a fresh state (the protocol of the
    DKVMN paper); by default the run's own `eval_max_len` (whole sequences unless set)."""
    model, vocab, manifest = load_model(artifact_dir)
    read, batcher, _, score = family(manifest["name"]).parts()
    _, test_ds = read(data_dir, fmt)
    if test_ds.n_cats != model.cfg.n_cats:
        raise ValueError(f"{test_ds.path} has K = {test_ds.n_cats} response categories but the model in "
                         f"{artifact_dir} predicts K = {model.cfg.n_cats}")
    if max_len is None:
        max_len = manifest.get("train_config", {}).get("eval_max_len")
    encoded = encode(test_ds, vocab)
    pred = predict_sequences(model, encoded, max_len=max_len, batcher=batcher)
    return {**score(pred["probs"], pred["targets"]), **unknown_share(encoded)}


def unknown_share(encoded: list[Encoded]) -> dict:
    """How many evaluated interactions had a question id the model never saw in training."""
    unknown = sum(int((q == Vocabulary.UNKNOWN).sum()) for q, _ in encoded)
    return {"unknown_questions": unknown}
