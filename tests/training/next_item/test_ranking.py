"""The official next-item evaluation: conservative ranks over all items, Recall/MRR/NDCG@K."""

import math

import numpy as np
import pytest
import torch

from nextstep.models.next_item import Markov
from nextstep.training.next_item.ranking import conservative_ranks, rank_metrics, session_ranks
from nextstep.training.next_item.sessions import SessionData


def test_metrics_equal_hand_computed_values():
    m = rank_metrics(np.array([1, 2, 6, 30]), ks=(1, 5, 20))
    assert m["recall@1"] == 0.25 and m["recall@5"] == 0.5 and m["recall@20"] == 0.75
    assert m["mrr@5"] == pytest.approx((1 + 1 / 2) / 4)
    assert m["mrr@20"] == pytest.approx((1 + 1 / 2 + 1 / 6) / 4)
    assert m["ndcg@20"] == pytest.approx((1 + 1 / math.log2(3) + 1 / math.log2(7)) / 4)
    assert m["ndcg@1"] == m["recall@1"] == m["mrr@1"]
    assert m["n_targets"] == 4


def test_ties_count_against_the_target_and_reserved_rows_never_compete():
    scores = torch.tensor([[9.0, 9.0, 1.0, 2.0, 2.0, 2.0, 0.5],   # target row 3 ties with 4 and 5
                           [9.0, 9.0, 5.0, 1.0, 1.0, 1.0, 1.0]])  # target row 2 is the best real item
    ranks = conservative_ranks(scores, torch.tensor([3, 2]))
    assert ranks.tolist() == [3, 1]  # rows 0 and 1 score 9 but are padding / unknown


def test_nan_scores_are_an_error_not_a_perfect_rank():
    with pytest.raises(ValueError, match="NaN"):
        conservative_ranks(torch.tensor([[0.0, 0.0, float("nan"), 1.0]]), torch.tensor([3]))


def test_session_ranks_follow_the_protocol_on_a_markov_chain():
    # rows 2..5; training transitions 2->3 (x2), 2->4 (x1), 3->5 (x1); none across sessions (5->2, 4->2)
    train = SessionData(["a", "b", "c"], np.array([2, 3, 5, 2, 4, 2, 3]), np.arange(7.0), np.array([0, 3, 5, 7]))
    model = Markov.fit(train.items, train.offsets, n_items=6)
    assert model.scores((torch.tensor([5]),))[0, 2] < 1  # 5 -> 2 crossed a session boundary: no transition
    test = SessionData(["t", "u"], np.array([2, 4, 3, 5, 2, 3]), np.arange(6.0), np.array([0, 2, 6]))
    ranks = session_ranks(model, test).tolist()
    # t: 2 -> 4: 3 (count 2) beats 4 (count 1) -> rank 2
    # u: 3 -> 5: rank 1; 5 -> 2: no successors, popularity (2 clicked 3 times) puts 2 first -> rank 1;
    #    2 -> 3: rank 1
    assert sorted(ranks) == sorted([2, 1, 1, 1])
    assert len(ranks) == 4  # one target per event after the first


def test_the_popularity_baseline_from_counts_is_the_popularity_models_evaluation():
    """The baseline `train` shows next to a next-item model's metrics, without scoring every item at every target."""
    from nextstep.models.next_item import Popularity
    from nextstep.training.data import Vocabulary
    from nextstep.training.next_item.ranking import evaluate_sessions, popularity_metrics
    from nextstep.training.next_item.run import encode_eval
    from nextstep.training.next_item.sessions import split_by_time, zipf_sessions

    train, test = split_by_time(zipf_sessions(300, 200, seed=2), 0.2)
    vocab = Vocabulary.build(train.items, min_count=3)  # rare items share the unknown row: never recommended
    rows, held_out = vocab.encode(train.items), encode_eval(test, vocab, train.items)
    assert (held_out.items == Vocabulary.UNKNOWN).any()
    # (the same ranks; the means differ in the last bit: the model's are summed in another order)
    assert popularity_metrics(rows, held_out, len(vocab)) == pytest.approx(
        evaluate_sessions(Popularity.fit(rows, len(vocab)), held_out), rel=1e-12)
