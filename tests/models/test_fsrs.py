"""FSRS-6 in PyTorch (models/fsrs.py) against fsrs-rs itself, and the flashcard model's start at FSRS-6."""

import numpy as np
import pytest
import torch

from nextstep.models import fsrs

fsrs_rs = pytest.importorskip("fsrs_rs_python")


def _cards(n=300, seed=0):
    """Random review histories: (rating, days since the previous review; 0 on the first), 1 to 20 reviews."""
    rng = np.random.default_rng(seed)
    cards = []
    for _ in range(n):
        k = int(rng.integers(1, 21))
        days = rng.choice([0, 0, 1, 2, 3, 7, 15, 40, 120, 400], size=k)
        days[0] = 0
        cards.append(list(zip(rng.choice([1, 2, 3, 4], size=k, p=[0.15, 0.1, 0.6, 0.15]), days, strict=True)))
    return cards


@pytest.mark.parametrize("w", [list(fsrs_rs.DEFAULT_PARAMETERS),
                               [0.5, 1.5, 4.0, 12.0, 5.5, 0.6, 1.8, 0.02, 1.3, 0.25, 0.9, 1.8, 0.1, 0.4, 1.2,
                                0.4, 2.2, 0.7, 0.2, 0.1, 0.35]])
def test_memory_state_equals_fsrs_rs(w):
    cards = _cards()
    C = max(len(c) for c in cards)
    rating = torch.zeros(len(cards), C, dtype=torch.float64)
    day = torch.zeros(len(cards), C, dtype=torch.float64)
    present = torch.zeros(len(cards), C, dtype=torch.bool)
    for i, c in enumerate(cards):  # right-aligned, as the model gathers a card's last rows
        for j, (g, _) in enumerate(c):
            rating[i, C - len(c) + j] = float(g)
            present[i, C - len(c) + j] = True
        day[i, C - len(c):] = torch.tensor(np.cumsum([dt for _, dt in c]), dtype=torch.float64)
    s, d = fsrs.memory_state(torch.tensor(w, dtype=torch.float64), rating, day, present)
    model = fsrs_rs.FSRS(w)
    for i, c in enumerate(cards):
        want = model.memory_state(fsrs_rs.FSRSItem([fsrs_rs.FSRSReview(int(g), int(dt)) for g, dt in c]))
        assert float(s[i]) == pytest.approx(want.stability, rel=1e-4)
        assert float(d[i]) == pytest.approx(want.difficulty, rel=1e-4)


def test_retrievability_is_090_at_the_stability_and_never_rises():
    w = torch.tensor(fsrs.DEFAULT_W, dtype=torch.float64)
    s = torch.tensor([0.5, 3.0, 40.0], dtype=torch.float64)
    assert torch.allclose(fsrs.retrievability(w, s, s), torch.full_like(s, 0.9))
    days = torch.arange(0, 4000, dtype=torch.float64)[:, None]
    r = fsrs.retrievability(w, s, days)
    assert (r.diff(dim=0) <= 0).all() and float(r[0].min()) == 1.0
