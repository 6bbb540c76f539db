"""MRN training: the loss falls, the model beats popularity on data with sequential signal, and a run
end to end (train_next_item on a generated data set directory) exports with parity."""

import json

import numpy as np
import torch

from nextstep.models.mrn import MRN, MRNConfig
from nextstep.models.next_item import Popularity
from nextstep.training.data import Vocabulary
from nextstep.training.mrn_loop import MRNTrainConfig, fit_mrn, length_batches
from nextstep.training.next_item_run import load_next_item, train_next_item
from nextstep.training.ranking import evaluate_sessions
from nextstep.training.sessions import split_by_time, write_gru4rec_tsv, zipf_sessions

SMALL = dict(dim=16, modulus=8, history=4, parallel=2, temperature=0.2, sigma=1.0, repeat=0.5)


def generated(n_sessions=800, n_items=60, seed=1):
    return split_by_time(zipf_sessions(n_sessions, n_items, follow=0.7, seed=seed), 0.2)


def test_length_batches_cover_every_session_once():
    lengths = np.array([1, 2, 5, 3, 2, 9, 4, 2])
    batches = length_batches(lengths, 6, np.random.default_rng(0))
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == [1, 2, 3, 4, 5, 6, 7]  # the one-event session has no target


def test_training_lowers_the_loss_and_beats_popularity():
    torch.manual_seed(0)
    train, test = generated()
    vocab = Vocabulary.build(train.items)
    train, test = train.encode(vocab, drop_unknown=False), test.encode(vocab)
    model = MRN(MRNConfig(n_items=len(vocab), **SMALL))
    cfg = MRNTrainConfig(epochs=8, batch_size=128, curriculum=[[1, 1, 2]], lambda_contrastive=0.1,
                         lambda_l2=1e-4, lr_final=0.3)
    history = fit_mrn(model, train, cfg, progress=False, log=False)
    assert history[-1]["train_nll"] < history[0]["train_nll"]
    assert [round(row["lr"], 6) for row in history] == [round(cfg.lr * (1 - 0.7 * e / 7), 6) for e in range(8)]
    assert (history[0]["K"], history[0]["L"]) == (1, 2) and (history[-1]["K"], history[-1]["L"]) == (2, 4)
    assert (model.k_active, model.l_active) == (2, 4)  # restored after the curriculum
    mrn = evaluate_sessions(model, test)
    popularity = evaluate_sessions(Popularity.fit(train.items, len(vocab)), test)
    assert mrn["recall@5"] > popularity["recall@5"] + 0.05
    assert mrn["mrr@5"] > popularity["mrr@5"]


def test_train_next_item_end_to_end_with_export_parity(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    train, test = generated(n_sessions=300, n_items=150, seed=2)
    write_gru4rec_tsv(train, data / "gen_train_full.txt")
    write_gru4rec_tsv(test, data / "gen_test.txt")
    cfg = MRNTrainConfig(epochs=2, batch_size=128, curriculum=[[1, 1, 2]],
                         model=dict(SMALL, use_context=True, alpha=1.0, repeat_learned=True,
                                    heads={"transition": {"rank": 8, "window": 2}}))
    out = tmp_path / "artifact"
    manifest = train_next_item("mrn", data, out, cfg=cfg, progress=False, log=False, top_k=20)
    assert manifest["parity"]["passed"] and manifest["family"] == "mrn"
    assert [s["name"] for s in manifest["state"]] == ["history", "context", "count"]
    assert json.loads((out / "manifest.json").read_text())["metrics"]["test"]["n_targets"] > 0
    model, vocab, _ = load_next_item(out)
    assert isinstance(model, MRN) and model.cfg.use_context and model.cfg.dim == 16
    assert list(model.heads) == ["transition"] and model.gamma is not None  # the heads come back from the artifact


def test_every_mrn_config_file_builds_its_model():
    from pathlib import Path
    paths = sorted((Path(__file__).parents[2] / "configs").glob("mrn_*.json"))
    assert len(paths) >= 2
    for path in paths:
        cfg = MRNTrainConfig(**json.loads(path.read_text()))
        model = MRN(MRNConfig(n_items=50, **cfg.model))
        assert set(model.heads) == set(cfg.model.get("heads", {})), path.name
