"""One next-item run end to end: read a session data set, train, evaluate with the official protocol, export.

    *_train_full --> training (or *_train_tr with valid=True, for tuning)
    *_test       --> metrics.test (or *_train_valid with valid=True; the test file is then never read)

Every next-item family runs here: its entry in families.py gives its fit, function(entry, cfg, train, n_items,
progress, log) -> (model, history), its training config, reader and metrics. The item vocabulary is built from
the training sessions; test events whose item is unknown to it are dropped before evaluation, as the
official protocol does.
"""

import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ...models.next_item import NextItemModel
from ..data import Vocabulary, fingerprint, hide_ids, unknown_record
from ..export import load_weights
from ..families import family, restore
from .export import TASK, export_next_item
from .ranking import popularity_metrics
from .sessions import SessionData


def train_next_item(entry, data_dir: str | Path, out_dir: str | Path, *, cfg=None, valid: bool = False,
                    fmt: str | None = None, progress: bool = True, log: bool = True, top_k: int = 100) -> dict:
    """The run of the next-item families: `entry` is the family's registry entry (or its name)."""
    entry = family(entry)
    if entry.task != TASK:
        raise ValueError(f"{entry.name} is a {entry.task} model, not a {TASK} one")
    read, _, _, score = entry.parts()
    cfg = cfg if cfg is not None else entry.resolve("train_config")()
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    started = time.perf_counter()
    train, test = read(data_dir, valid=valid, fmt=fmt)
    if log:
        print(describe_data(train, test, "validation" if valid else "test"), flush=True)
    # items clicked fewer than min_item_count times share the unknown row (1), and a seeded unknown_share of the
    # training clicks go through it: the row then stands for an item added after training (never recommended)
    vocab = Vocabulary.build(train.items, min_count=cfg.min_item_count)
    # (a family whose answer does not depend on the clicks, popularity, hides none: an unknown click changes nothing)
    counts_only = not entry.reads_clicks
    share = 0.0 if counts_only else cfg.unknown_share
    train_enc = train.encode(vocab, drop_unknown=False)
    train_enc.items = hide_ids([train_enc.items], share, cfg.seed)[0]
    unknown = unknown_record(len(vocab.ids), len(np.unique(train.items)), cfg.min_item_count, share,
                             [train_enc.items], answers=True if counts_only else None)
    test_enc = encode_eval(test, vocab, train.items)
    if not (test_enc.lengths() > 1).any():  # checked before training, which would be wasted
        raise ValueError(f"{test.path}: no session there has two clicks on items the training data has, so there is "
                         "no target to score")
    model, history = entry.resolve("fit")(entry, cfg, train_enc, len(vocab), progress, log)
    train_seconds = time.perf_counter() - started
    split = "valid" if valid else "test"
    dropped = test.n_events - test_enc.n_events
    baseline = popularity_metrics(vocab.encode(train.items), test_enc, len(vocab))  # the training clicks' counts
    metrics = {split: {**score(model, test_enc), "dropped_unknown_events": dropped},
               "baseline": {"name": "popularity", **baseline}}
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = {
        "name": entry.name,
        "version": time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "data": {"dir": str(data_dir), "train_file": train.path, "eval_file": test.path, "split": split,
                 "fingerprint": fingerprint(*dict.fromkeys([train.path, test.path])) if train.path else None,
                 "n_train_sessions": len(train), "n_train_events": train.n_events,
                 "n_eval_sessions": len(test_enc), "n_items": len(vocab) - 2},
        "unknown": unknown,
        "metrics": metrics,
        "train_config": asdict(cfg),
        "training": {"epochs": history, "seconds": round(train_seconds, 1), "torch": torch.__version__},
    }
    manifest = export_next_item(model, out_dir, manifest=manifest, vocab_json=vocab.to_json(),
                                parity_sessions=parity_sessions(test_enc), top_k=top_k)
    return manifest


def describe_data(train: SessionData, test: SessionData, held_out: str) -> str:
    """The log's line on the data: the files, the sessions and clicks read, and how one file was split."""
    files = train.path if train.path == test.path else f"{train.path} and {test.path}"
    line = (f"data: {files}: {len(train)} training and {len(test)} {held_out} sessions, "
            f"{train.n_events + test.n_events} clicks")
    return line + (f"; {train.notes['split']}" if "split" in train.notes else "")


def encode_eval(test: SessionData, vocab: Vocabulary, train_items: np.ndarray) -> SessionData:
    """Held-out sessions as model rows, by the official protocol: a click on an item the training data never had
    is dropped (then sessions left with one click); a click on an item it had too rarely for a row of its own
    (min_item_count) is kept, as the unknown row: as input it goes through that row, as a target it is a miss."""
    if len(vocab.ids) == len(np.unique(train_items)):  # every training item has its row
        return test.encode(vocab)
    seen = Vocabulary.build(train_items)
    kept = test.encode(seen)  # the official protocol's sessions and clicks, as rows of every training item
    kept.items = vocab.encode(np.asarray(seen.ids, dtype=np.int64)[kept.items - 2])
    return kept


def parity_sessions(data: SessionData, n: int = 8, length: int = 12) -> torch.Tensor:
    """The n longest held-out sessions cut (or cycled) to `length` items: the export parity batch."""
    longest = np.argsort(-data.lengths(), kind="stable")[:n]
    return torch.from_numpy(np.stack([np.resize(data.session(i), length) for i in longest]))


def load_next_item(artifact_dir: str | Path) -> tuple[NextItemModel, Vocabulary, dict]:
    artifact_dir = Path(artifact_dir)
    manifest = json.loads((artifact_dir / "manifest.json").read_text())
    if manifest.get("task") != TASK:
        raise ValueError(f"{artifact_dir} holds a {manifest.get('task')!r} model, not a next-item one")
    model, manifest = load_weights(artifact_dir, restore)
    vocab = Vocabulary.from_json(json.loads((artifact_dir / manifest["vocabularies"]["items"]).read_text()))
    return model, vocab, manifest


def evaluate_next_item(artifact_dir: str | Path, data_dir: str | Path, valid: bool = False,
                       fmt: str | None = None) -> dict:
    """Re-measure an artifact on a data set's test file (or validation file) with the official protocol."""
    model, vocab, manifest = load_next_item(artifact_dir)
    read, _, _, score = family(manifest["name"]).parts()
    _, test = read(data_dir, valid=valid, fmt=fmt)
    encoded = test.encode(vocab)
    return {**score(model, encoded), "dropped_unknown_events": test.n_events - encoded.n_events}
