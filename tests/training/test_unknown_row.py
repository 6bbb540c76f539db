"""The unknown row (issue 37 part 6): questions (items) seen fewer than min_question_count (min_item_count) times
in the fitting data map to row 1, a seeded share of the fitting interactions goes through it, and row 1's parameters
are trained; the manifest records how. Tiny generated data."""

import json

import numpy as np
import pytest
import torch

from nextstep.training.data import Vocabulary, check_unknown_options, hide_ids
from nextstep.training.families import family
from nextstep.training.kt.data import KTDataset, Sequence
from nextstep.training.kt.loop import TrainConfig
from nextstep.training.kt.run import load_model, train_model
from nextstep.training.kt.simakt_run import build_vocab, encode_questions, vocab_parts
from nextstep.training.next_item.ranking import conservative_ranks
from nextstep.training.next_item.run import encode_eval
from nextstep.training.next_item.sessions import SessionData


def test_ids_seen_fewer_times_than_the_minimum_share_the_unknown_row():
    ids = np.array(["a", "b", "b", "c", "c", "c"])
    vocab = Vocabulary.build(ids, min_count=2)
    assert vocab.ids == ["b", "c"]
    assert vocab.encode(np.array(["a", "b", "c", "z"])).tolist() == [1, 2, 3, 1]
    assert Vocabulary.build(ids).ids == ["a", "b", "c"]  # the default keeps every id seen
    numeric = Vocabulary.build(np.array([5, 5, 7, 9, 9]), min_count=2)
    assert numeric.ids == [5, 9] and numeric.encode(np.array([7])).tolist() == [1]


def test_hide_ids_is_seeded_and_leaves_padding_alone():
    rows = [np.arange(20_000) % 50]  # rows 0 and 1 among them
    hidden = hide_ids(rows, 0.1, seed=3)[0]
    assert np.array_equal(hidden, hide_ids(rows, 0.1, seed=3)[0]) and not np.array_equal(hidden, rows[0])
    changed = hidden != rows[0]
    assert (hidden[changed] == 1).all() and (rows[0][changed] >= 2).all()
    assert 0.08 < changed.mean() < 0.12
    assert hide_ids(rows, 0.0, seed=3)[0] is rows[0]


@pytest.mark.parametrize("min_count, share", [(0, 0.1), (2, 1.0), (2, -0.1), (True, 0.1)])
def test_bad_unknown_options_are_refused(min_count, share):
    with pytest.raises(ValueError):
        check_unknown_options(min_count, share)
    with pytest.raises(ValueError):
        TrainConfig(min_question_count=min_count, unknown_share=share)


def _write_three_line(path, sequences):
    with open(path, "w") as f:
        for q, r in sequences:
            f.write(f"{len(q)}\n{','.join(map(str, q))}\n{','.join(map(str, r))}\n")


@pytest.fixture(scope="module")
def rare_data(tmp_path_factory):
    """Questions 0..7 answered often; 100, 101 and 102 by one student each (rare); K = 2."""
    d = tmp_path_factory.mktemp("rare")
    rng = np.random.default_rng(0)
    seqs = []
    for s in range(40):
        q = rng.integers(0, 8, 12)
        if s < 3:
            q[5] = 100 + s
        seqs.append((q, rng.integers(0, 2, 12)))
    _write_three_line(d / "rare_train.txt", seqs)
    _write_three_line(d / "rare_test.txt", seqs[-8:])
    return d


TINY = {"deep_gpcm": {"memory_size": 4, "key_dim": 8, "value_dim": 8, "summary_dim": 8, "irt_init": False},
        "dkt": {"hidden": 8, "embed_dim": 8}}
ROW_1 = {"deep_gpcm": lambda m: m.question_embed.weight[1], "dkt": lambda m: m.out_w.weight[1]}


@pytest.mark.slow  # trains and exports (about 40 s each on the shared 2 cores)
@pytest.mark.parametrize("name", ["deep_gpcm", "dkt"])
def test_rare_questions_map_to_row_1_and_row_1_is_trained(name, rare_data, tmp_path):
    cfg = TrainConfig(epochs=2, model=TINY[name], min_question_count=3, unknown_share=0.05)
    manifest = train_model(name, rare_data, tmp_path / "a", cfg=cfg, progress=False, log=False)
    assert manifest["parity"]["passed"]  # step-by-step equals full-sequence, PyTorch equals ONNX Runtime
    model, vocab, manifest = load_model(tmp_path / "a")
    assert sorted(vocab.ids) == list(range(8))  # 100..102: too rare for a row of their own
    unknown = manifest["unknown"]
    assert unknown["row"] == 1 and unknown["min_count"] == 3 and unknown["share"] == 0.05
    assert unknown["rare_ids"] >= 2 and unknown["interactions"] >= unknown["rare_ids"] and unknown["answers"]
    assert manifest["train_config"]["min_question_count"] == 3
    torch.manual_seed(cfg.seed)  # the weights the run started from
    initial = family(name).build({"n_questions": len(vocab), "n_cats": 2, **TINY[name]})
    assert not torch.allclose(ROW_1[name](model), ROW_1[name](initial))


@pytest.mark.slow
def test_without_the_options_row_1_stays_untrained(rare_data, tmp_path):
    cfg = TrainConfig(epochs=1, model=TINY["dkt"], min_question_count=1, unknown_share=0.0)
    train_model("dkt", rare_data, tmp_path / "a", cfg=cfg, progress=False, log=False)
    model, vocab, manifest = load_model(tmp_path / "a")
    assert 100 in vocab.ids and manifest["unknown"]["interactions"] == 0
    assert manifest["unknown"]["answers"] is False  # the service refuses unknown ids (422)
    torch.manual_seed(cfg.seed)
    initial = family("dkt").build({"n_questions": len(vocab), "n_cats": 2, **TINY["dkt"]})
    assert torch.equal(ROW_1["dkt"](model), ROW_1["dkt"](initial))
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["unknown"]["rare_ids"] == 0


def test_simakt_vocabulary_gives_rare_skills_and_pairs_no_row():
    seqs = [Sequence("a", np.array([1, 1, 1, 2]), np.array([1, 0, 1, 1]), problems=np.array([10, 10, 11, 12])),
            Sequence("b", np.array([1, 1, 3]), np.array([0, 1, 1]), problems=np.array([10, 13, 14]))]
    vocab = build_vocab(KTDataset(seqs, 2, "x", "dtransformer"), min_count=2)
    pairs, skills, _ = vocab_parts(vocab)
    assert skills.ids == [1] and pairs == [(10, 1)]
    rows = encode_questions(vocab, np.array([1, 1, 2, 3]), np.array([10, 11, 12, 14]))
    assert rows.tolist() == [2, 3, 1, 1]  # the pair's row, skill 1's bare row, then unknown twice


def test_rare_test_items_are_misses_and_unseen_ones_are_dropped():
    train_items = np.array([5, 5, 6, 6, 7])  # 7: once
    vocab = Vocabulary.build(train_items, min_count=2)
    test = SessionData(["s"], np.array([5, 7, 6, 9]), np.arange(4.0), np.array([0, 4]))
    encoded = encode_eval(test, vocab, train_items)
    assert encoded.items.tolist() == [2, 1, 3]  # 9 was never in training: dropped; 7 too rare: the unknown row
    scores = torch.tensor([[0.0, 9.0, 1.0, 2.0]])
    assert conservative_ranks(scores, torch.tensor([1])).tolist() == [3]  # past both items: a miss at every cutoff
    assert conservative_ranks(scores, torch.tensor([3])).tolist() == [1]
