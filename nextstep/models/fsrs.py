"""FSRS-6's memory model in PyTorch: a card's (stability, difficulty) after its reviews, and its forgetting curve.

The flashcard model (time_aware.py) starts from FSRS-6 and learns corrections to it; this module is the FSRS-6
part, written as tensor operations so that it runs inside the exported graphs. It follows fsrs-rs (the
parameters come from its optimiser, nextstep/training/srs_eval.py), with w the 21 parameters:

    first review, rating G:    S = w[G-1],  D = clamp(w4 - exp(w5 (G - 1)) + 1, 1, 10)
    same day (t = 0):          S' = S * exp(w17 (G - 3 + w18)) * S^-w19, at least S when G >= 2
    recalled (G > 1):          S' = S (1 + e^w8 (11 - D) S^-w9 (e^(w10 (1 - R)) - 1) * w15 [Hard] * w16 [Easy])
    forgotten (G = 1):         S' = min(w11 D^-w12 ((S + 1)^w13 - 1) e^(w14 (1 - R)), S / e^(w17 w18))
    difficulty:                D' = clamp(w7 D0(4) + (1 - w7) (D - w6 (G - 3) (10 - D) / 9), 1, 10)
    retrievability:            R(t) = (1 + f t / S)^-w20, f = 0.9^(-1 / w20) - 1, so R(S) = 0.9

with t in whole scheduler days since the card's previous review and S clamped to [0.001, 36500].
tests/models/test_fsrs.py checks the recurrence against fsrs-rs itself on real cards.
"""

import torch

# fsrs-rs 0.9's DEFAULT_PARAMETERS (FSRS-6), fitted by its authors on many users' reviews: the curve a user with
# too few reviews for a fit gets
DEFAULT_W = (0.212, 1.2931, 2.3065, 8.2956, 6.4133, 0.8334, 3.0194, 0.001, 1.8722, 0.1666, 0.796, 1.4835, 0.0614,
             0.2629, 1.6483, 0.6014, 1.8729, 0.5425, 0.0912, 0.0658, 0.1542)
S_MIN, S_MAX = 0.001, 36500.0


def initial_difficulty(w: torch.Tensor, rating: torch.Tensor) -> torch.Tensor:
    return w[4] - torch.exp(w[5] * (rating - 1)) + 1


def retrievability(w: torch.Tensor, stability: torch.Tensor, days: torch.Tensor) -> torch.Tensor:
    """R after `days` (>= 0) at `stability`: never rises with days."""
    factor = torch.pow(0.9, -1.0 / w[20]) - 1.0
    return torch.pow(1.0 + factor * days / stability, -w[20])


def review(w: torch.Tensor, stability: torch.Tensor, difficulty: torch.Tensor, rating: torch.Tensor,
           days: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, D) after one review with `rating` (float 1..4) `days` (float, whole days) after the card's previous
    one; `first` (bool) marks the card's first review, where the previous (S, D) are ignored."""
    s = stability.clamp(S_MIN, S_MAX)
    r = retrievability(w, s, days)
    one = torch.ones_like(rating)
    bonus = torch.where(rating == 2, w[15] * one, torch.where(rating == 4, w[16] * one, one))
    recalled = s * (1 + torch.exp(w[8]) * (11 - difficulty) * torch.pow(s, -w[9])
                    * (torch.exp((1 - r) * w[10]) - 1) * bonus)
    forgot = w[11] * torch.pow(difficulty, -w[12]) * (torch.pow(s + 1, w[13]) - 1) * torch.exp((1 - r) * w[14])
    forgot = torch.minimum(forgot, s / torch.exp(w[17] * w[18]))
    short = torch.exp(w[17] * (rating - 3 + w[18])) * torch.pow(s, -w[19])
    short = s * torch.where(rating >= 2, short.clamp(min=1.0), short)
    new_s = torch.where(days == 0, short, torch.where(rating == 1, forgot, recalled))
    linear = difficulty - w[6] * (rating - 3) * (10 - difficulty) / 9
    new_d = w[7] * initial_difficulty(w, 4 * one) + (1 - w[7]) * linear
    start_s = w[(rating.long() - 1).clamp(0, 3)]
    start_d = initial_difficulty(w, rating)
    return (torch.where(first, start_s, new_s).clamp(S_MIN, S_MAX),
            torch.where(first, start_d, new_d).clamp(1.0, 10.0))


def memory_state(w: torch.Tensor, rating: torch.Tensor, day: torch.Tensor,
                 present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A card's (S, D) after its reviews: rating (..., C) float, day (..., C) scheduler day numbers, present
    (..., C) bool, oldest first; absent steps leave the state as it is, the first present one starts it.
    A card with no present step gets (1, 5), which callers do not use."""
    s = torch.ones_like(rating[..., 0])
    d = torch.full_like(s, 5.0)
    started = torch.zeros_like(present[..., 0])
    last_day = torch.zeros_like(day[..., 0])
    for c in range(rating.shape[-1]):
        here = present[..., c]
        new_s, new_d = review(w, s, d, rating[..., c], (day[..., c] - last_day).clamp(min=0), ~started)
        s, d = torch.where(here, new_s, s), torch.where(here, new_d, d)
        last_day = torch.where(here, day[..., c], last_day)
        started = started | here
    return s, d
