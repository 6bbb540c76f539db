"""GRU4Rec training: session-parallel batches, resets, no leak across slots, losses, optimiser, sampler."""

import re
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nextstep.models.gru4rec import GRU4Rec, GRU4RecConfig
from nextstep.models.next_item import Popularity
from nextstep.training.data import Vocabulary
from nextstep.training.next_item.gru4rec_loop import (
    AdagradM,
    GRU4RecTrainConfig,
    LogQ,
    NegativeSampler,
    carry,
    fit_gru4rec,
    session_parallel,
)
from nextstep.training.next_item.gru4rec_step import TrainStep, sampled_loss
from nextstep.training.next_item.ranking import evaluate_sessions
from nextstep.training.next_item.sessions import zipf_sessions

LENGTHS = [2, 5, 3, 2, 7, 1, 4, 2, 3]


def offsets_of(lengths):
    return np.r_[0, np.cumsum(lengths)].astype(np.int64)


@pytest.mark.parametrize("batch_size", [1, 3, 4, 20])
def test_every_target_is_visited_once_and_the_batch_shrinks_instead_of_ending_early(batch_size):
    offsets = offsets_of(LENGTHS)
    order = np.random.default_rng(0).permutation(len(LENGTHS))
    seen, sizes = [], []
    for positions, _, _ in session_parallel(offsets, order, batch_size):
        sizes.append(len(positions))
        seen.extend(positions.tolist())
    targets = [p for s, n in enumerate(LENGTHS) for p in range(offsets[s], offsets[s] + n - 1)]
    assert sorted(seen) == targets  # each input position once: every event but sessions' last is trained on
    n_trainable = sum(n > 1 for n in LENGTHS)  # a one-event session has no target: its slot is refilled
    assert sizes[0] == min(batch_size, n_trainable) and sizes == sorted(sizes, reverse=True)


def test_resets_happen_exactly_when_a_slot_starts_a_new_session():
    offsets = offsets_of(LENGTHS)
    order = np.arange(len(LENGTHS))
    starts = set(offsets[:-1].tolist())
    slot_pos = None
    for positions, keep, reset in session_parallel(offsets, order, 3):
        reset = np.zeros(len(positions), bool) if reset is None else reset
        if keep is not None:
            slot_pos = slot_pos[keep]
        for b, p in enumerate(positions):
            assert reset[b] == (p in starts)  # zeroed before a session's first item, never elsewhere
            if slot_pos is not None and not reset[b]:
                assert p == slot_pos[b] + 1  # a slot that is not reset continues its session
        slot_pos = positions


def tiny_model(n_items=30, **kw):
    torch.manual_seed(0)
    return GRU4Rec(GRU4RecConfig(n_items=n_items, layers=(8,), **kw))


def training_states(m, items, offsets, order, batch_size):
    """The state of every input position after the training step that fed it (weights left unchanged)."""
    step, out = TrainStep(m), {}
    state = m.init_state(min(batch_size, len(order)))
    for positions, keep, reset in session_parallel(offsets, order, batch_size):
        state = carry(state, keep, reset)
        pos = torch.from_numpy(positions)
        _, state = step(state, items[pos], torch.cat([items[pos + 1], torch.arange(2, 9)]))
        out.update({int(p): state[0][b].clone() for b, p in enumerate(positions)})
    return out


def test_states_in_a_mini_batch_equal_each_session_run_alone():
    data = zipf_sessions(12, 28, (2, 6), seed=0)
    data.items = data.items + 1  # rows 2..29
    m = tiny_model(dropout_hidden=0.0).train()  # the training path, without dropout: deterministic states
    items = torch.from_numpy(data.items)
    got = training_states(m, items, data.offsets, np.arange(len(data)), 4)
    m.eval()
    for s in range(len(data)):
        alone = m.init_state(1)
        for p in range(data.offsets[s], data.offsets[s + 1] - 1):
            alone = m.step(alone, items[p:p + 1])
            torch.testing.assert_close(got[p], alone[0][0], atol=1e-6, rtol=0)


def test_changing_one_session_changes_no_other_slot():
    data = zipf_sessions(10, 28, (3, 6), seed=1)
    data.items = data.items + 1
    m = tiny_model(dropout_hidden=0.0).train()
    order = np.arange(len(data))
    changed = data.items.copy()
    changed[data.offsets[2]:data.offsets[3]] = 29  # session 2 becomes something else
    a = training_states(m, torch.from_numpy(data.items), data.offsets, order, 4)
    b = training_states(m, torch.from_numpy(changed), data.offsets, order, 4)
    for p in a:
        if not data.offsets[2] <= p < data.offsets[3]:
            torch.testing.assert_close(a[p], b[p], atol=0, rtol=0)
    assert any(not torch.equal(a[p], b[p]) for p in range(data.offsets[2], data.offsets[3] - 1))


def test_cross_entropy_and_bpr_equal_their_definitions():
    O = torch.randn(4, 9)
    assert sampled_loss(O, "cross-entropy").item() == pytest.approx(F.cross_entropy(O, torch.arange(4),
                                                                                  reduction="sum").item(), rel=1e-6)
    manual = sum(-F.logsigmoid(O[b, b] - O[b, j]).item() for b in range(4) for j in range(9) if j != b) / 8
    assert sampled_loss(O, "bpr").item() == pytest.approx(manual, rel=1e-5)


def test_bpr_max_equals_its_formula_and_stays_finite_where_a_naive_log_would_not():
    O, reg = torch.randn(3, 7), 0.7
    total = 0.0
    for b in range(3):
        neg = [j for j in range(7) if j != b]
        s = torch.softmax(O[b, neg], 0)
        total += (-torch.log((s * torch.sigmoid(O[b, b] - O[b, neg])).sum()) + reg * (s * O[b, neg] ** 2).sum()).item()
    assert sampled_loss(O, "bpr-max", bpreg=reg).item() == pytest.approx(total, rel=1e-5)
    huge = torch.tensor([[-200.0, 300.0, 250.0], [0.0, 0.0, 0.0]])  # target far below the negatives
    value = sampled_loss(huge, "bpr-max", bpreg=0.0)
    assert torch.isfinite(value) and value.item() > 400  # -log sigmoid(-500) ~ 500, not log(0) = inf
    O.requires_grad_(True)
    sampled_loss(O * 100, "bpr-max", bpreg=1.0, elu_param=0.5).backward()
    assert torch.isfinite(O.grad).all()


def test_adagrad_momentum_dense_and_sparse_rows():
    table = torch.nn.Embedding(6, 2, sparse=True)
    dense = torch.nn.Parameter(torch.ones(3))
    opt = AdagradM([table.weight, dense], lr=0.1, momentum=0.5, eps=1e-6)
    before = table.weight.detach().clone()
    grads = [torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.5, 0.5, 0.5])]
    acc, mom, expected = torch.zeros(3), torch.zeros(3), torch.ones(3)
    for g in grads:
        opt.zero_grad()
        (dense * g).sum().backward()
        table(torch.tensor([1, 1, 4])).sum().backward()  # rows 1 (twice) and 4 only
        opt.step()
        acc += g * g
        mom = 0.5 * mom - 0.1 * g / (acc + 1e-6).sqrt()
        expected = expected + mom
    torch.testing.assert_close(dense.detach(), expected)
    after = table.weight.detach()
    untouched = [0, 2, 3, 5]
    torch.testing.assert_close(after[untouched], before[untouched], atol=0, rtol=0)
    # row 1 got gradient 2 (two lookups) twice: acc 4 then 8; momentum 0.5
    m1 = -0.1 * 2 / (4 + 1e-6) ** 0.5
    m2 = 0.5 * m1 - 0.1 * 2 / (8 + 1e-6) ** 0.5
    torch.testing.assert_close(after[1], before[1] + m1 + m2)


def test_negative_sampler_follows_popularity_to_the_alpha():
    counts = np.array([0, 0, 100, 25, 4, 0])
    sampler = NegativeSampler(counts, alpha=0.5, n_sample=1000, generator=torch.Generator().manual_seed(0),
                              cache_steps=50)
    draws = torch.cat([sampler.draw() for _ in range(120)])  # crosses a cache refill
    freq = np.bincount(draws.numpy(), minlength=6) / len(draws)
    assert freq[[0, 1, 5]].sum() == 0
    np.testing.assert_allclose(freq[2:5], np.array([10, 5, 2]) / 17, atol=0.01)


@pytest.mark.parametrize("loss", ["cross-entropy", "bpr", "bpr-max"])
def test_training_learns_sequential_structure_that_popularity_cannot(loss):
    data = zipf_sessions(400, 40, (3, 8), follow=0.8, seed=0)
    vocab = Vocabulary.build(data.items)
    enc = data.encode(vocab, drop_unknown=False)
    test = zipf_sessions(100, 40, (3, 8), follow=0.8, seed=1).encode(vocab)
    cfg = GRU4RecTrainConfig(loss=loss, epochs=3, n_sample=16, batch_size=16, lr=0.1, bpreg=0.5,
                             model={"layers": (16,)})
    torch.manual_seed(0)
    m = GRU4Rec(GRU4RecConfig(n_items=len(vocab), **cfg.model))
    history = fit_gru4rec(m, enc, cfg, progress=False, log=False)
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert history[0]["targets"] == int((enc.lengths() - 1).sum())
    gru = evaluate_sessions(m, test)["recall@5"]
    pop = evaluate_sessions(Popularity.fit(enc.items, len(vocab)), test)["recall@5"]
    assert gru > pop + 0.2


def test_the_progress_bar_counts_the_epochs_steps(monkeypatch):
    from tests.training.test_loop import Terminal

    data = zipf_sessions(60, 20, (2, 9), follow=0.5, seed=2)
    vocab = Vocabulary.build(data.items)
    enc = data.encode(vocab, drop_unknown=False)
    steps = sum(1 for _ in session_parallel(enc.offsets, np.arange(len(enc)), 8))  # sessions by time: this order
    monkeypatch.setattr(sys, "stderr", Terminal())
    fit_gru4rec(tiny_model(n_items=len(vocab)), enc, GRU4RecTrainConfig(epochs=1, batch_size=8, n_sample=4,
                                                                        session_order="time"), log=False)
    shown = sys.stderr.getvalue()
    assert re.search(rf"epoch 1/1: +0%\|.*\| 0/{steps} \[", shown), shown


def test_config_is_validated():
    with pytest.raises(ValueError, match="loss"):
        GRU4RecTrainConfig(loss="top1")
    with pytest.raises(ValueError, match="momentum"):
        GRU4RecTrainConfig(momentum=1.0)
    with pytest.raises(ValueError, match="n_sample"):
        GRU4RecTrainConfig(n_sample=-1)


@pytest.mark.parametrize("loss", ["bpr", "bpr-max", "cross-entropy"])
def test_without_sampled_negatives_the_last_lone_slot_is_skipped_not_nan(loss):
    data = zipf_sessions(60, 20, (2, 9), follow=0.5, seed=2)
    vocab = Vocabulary.build(data.items)
    m = tiny_model(n_items=len(vocab))
    cfg = GRU4RecTrainConfig(loss=loss, epochs=2, n_sample=0, batch_size=4)
    history = fit_gru4rec(m, data.encode(vocab, drop_unknown=False), cfg, progress=False, log=False)
    assert all(np.isfinite(h["train_loss"]) for h in history)
    assert all(torch.isfinite(p).all() for p in m.parameters())


def test_logq_corrects_targets_by_log_count_and_sampled_negatives_by_alpha_log_count():
    counts = np.array([0, 0, 3, 1, 8])
    log_q = LogQ(counts, sample_alpha=0.5, strength=2.0)
    columns = torch.tensor([2, 3, 3, 4, 2])  # two in-batch targets, then three sampled negatives
    want = 2.0 * np.log([3, 1, 1 ** 0.5, 8 ** 0.5, 3 ** 0.5])
    np.testing.assert_allclose(log_q(columns, 2).numpy(), want, rtol=1e-6)
    np.testing.assert_allclose(log_q(columns[:2], 2).numpy(), want[:2], rtol=1e-6)  # no sampled negatives
