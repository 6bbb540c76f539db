"""FSRS-6's memory model in PyTorch: a card's (stability, difficulty) after its reviews, and its forgetting curve.

The flashcard model (time_aware.py) starts from FSRS-6 and learns corrections to it; this module is the FSRS-6
part, written as tensor operations so that it runs inside the exported graphs. It follows fsrs-rs (the
parameters come from its optimiser, nextstep/training/srs/eval.py), with w the 21 parameters:

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


def _w(w: torch.Tensor, k: int) -> torch.Tensor:
    """Parameter k of w (..., 21) with a trailing axis of 1, so that it broadcasts against (..., C) steps: w may be
    one user's (21,) or one per batch row ((B, 21), (B, 1, 21), ...: one user's parameters per row)."""
    return w[..., k:k + 1]


def initial_difficulty(w: torch.Tensor, rating: torch.Tensor) -> torch.Tensor:
    return _w(w, 4) - torch.exp(_w(w, 5) * (rating - 1)) + 1


def log_retrievability(decay: torch.Tensor, stability: torch.Tensor, days: torch.Tensor) -> torch.Tensor:
    """log R after `days` (>= 0) on FSRS-6's power curve with this decay (w20 in FSRS-6) and stability:
    -decay * log(1 + f days / S), f = 0.9^(-1 / decay) - 1, so R(S) = 0.9; never rises with days."""
    factor = torch.pow(torch.full_like(decay, 0.9), -1.0 / decay) - 1.0
    return -decay * torch.log1p(factor * days / stability)


def retrievability(w: torch.Tensor, stability: torch.Tensor, days: torch.Tensor) -> torch.Tensor:
    """R after `days` at `stability`, with the user's parameters w (21,)."""
    return torch.exp(log_retrievability(w[..., 20], stability, days))


def memory_state(w: torch.Tensor, rating: torch.Tensor, day: torch.Tensor,
                 present: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A card's (S, D) after its reviews: w the user's parameters, (21,) or (..., 21) broadcasting against the
    leading axes of the steps (one user per row), rating (..., C) float, day (..., C) scheduler day numbers, present
    (..., C) bool, oldest first, the present steps a suffix (the card's reviews, after padding). For a card with
    no present step the result is finite and meaningless; callers do not use it.

    The recurrence of the module docstring, arranged for a graph: everything that does not depend on the state is
    computed for all C steps at once, and the difficulty (which does not depend on the stability) in a loop of its
    own, so that the stability's loop has few operations a step (tests/models/test_fsrs.py: equal to fsrs-rs)."""
    one = torch.ones_like(rating)
    # a step continues the card's state when it and the step before are reviews; any other step (the first review,
    # and the padding before it, whose values the first review overwrites) starts it afresh
    cont = present & torch.cat([torch.zeros_like(present[..., :1]), present[..., :-1]], -1)
    days = torch.cat([torch.zeros_like(day[..., :1]), (day[..., 1:] - day[..., :-1]).clamp(min=0)], -1)
    start_s = torch.where(rating <= 1, _w(w, 0), torch.where(rating <= 2, _w(w, 1), torch.where(
        rating <= 3, _w(w, 2), _w(w, 3))))  # w[G - 1], per row
    start_d = initial_difficulty(w, rating).clamp(1.0, 10.0)
    # difficulty: D' = clamp(D * a + b, 1, 10) with a, b from the rating (mean reversion folded in)
    lean = _w(w, 6) * (rating - 3) / 9
    a = (1 - _w(w, 7)) * (1 + lean)
    b = _w(w, 7) * initial_difficulty(w, 4 * one) - (1 - _w(w, 7)) * 10 * lean
    # steps are (..., 1) slices (split keeps the axis: no squeeze and unsqueeze nodes in the exported loop)
    d, before = start_d[..., :1], []
    for a_c, b_c, d0, more in zip(*(x.split(1, -1) for x in (a, b, start_d, cont)), strict=True):
        before.append(d)
        d = torch.where(more, (d * a_c + b_c).clamp(1.0, 10.0), d0)
    d_before = torch.cat(before, -1)
    # the stability's step-independent factors
    factor = torch.pow(0.9, -1.0 / _w(w, 20)) - 1.0
    bonus = torch.where(rating == 2, _w(w, 15) * one, torch.where(rating == 4, _w(w, 16) * one, one))
    grow = torch.exp(_w(w, 8)) * bonus * (11 - d_before)
    lapse = _w(w, 11) * torch.pow(d_before, -_w(w, 12))
    short = torch.exp(_w(w, 17) * (rating - 3 + _w(w, 18)))
    least = (rating >= 2).to(rating.dtype)  # a same-day Hard, Good or Easy never lowers the stability
    floor = torch.exp(_w(w, 17) * _w(w, 18))
    s = start_s[..., :1]
    parts = (factor * days, grow, lapse, short, least, start_s, days == 0, rating == 1, cont)
    for fdt, g, lp, sh, lo, s0, same_day, again, more in zip(*(x.split(1, -1) for x in parts), strict=True):
        forget = 1 - torch.pow(1.0 + fdt / s, -_w(w, 20))  # 1 - R
        recalled = s * (1 + g * torch.pow(s, -_w(w, 9)) * (torch.exp(forget * _w(w, 10)) - 1))
        forgot = torch.minimum(lp * (torch.pow(s + 1, _w(w, 13)) - 1) * torch.exp(forget * _w(w, 14)), s / floor)
        same = s * torch.maximum(sh * torch.pow(s, -_w(w, 19)), lo)
        new = torch.where(same_day, same, torch.where(again, forgot, recalled))
        s = torch.where(more, new.clamp(S_MIN, S_MAX), s0)
    return s.squeeze(-1), d.squeeze(-1)
