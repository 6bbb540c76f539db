"""Plain IRT on response data: a joint MAP fit of a GPCM, used to warm-start the Deep-GPCM item parameters and as
the fitted-IRT reference of bench/gpcm_references.py.

Joint MAP: per-student theta with an N(0, 1) prior, per-item log-alpha with an N(0, 0.3^2) prior and K-1 ordered
thresholds (first threshold free, the gaps through softplus), all by L-BFGS on the summed log-likelihood. Callers
pass the sequences it may see (a training run: its fitting students only, never validation or test ones).
"""

import numpy as np
import torch
import torch.nn.functional as F

from .ordinal import gpcm_logits


def fit_gpcm(questions: list[np.ndarray], responses: list[np.ndarray], n_items: int, n_cats: int, *,
             max_iter: int = 500, rounds: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Per-student question and response arrays (item indices < n_items, responses 0 .. K-1) -> alpha (n_items,)
    and ordered beta (n_items, K-1). Items without data keep their prior values (alpha 1, beta 0, 0.69, ...)."""
    student = torch.from_numpy(np.concatenate([np.full(len(q), i) for i, q in enumerate(questions)]))
    item = torch.from_numpy(np.concatenate(questions).astype(np.int64))
    resp = torch.from_numpy(np.concatenate(responses).astype(np.int64))
    theta = torch.zeros(len(questions), requires_grad=True)
    log_alpha = torch.zeros(n_items, requires_grad=True)
    first = torch.zeros(n_items, 1, requires_grad=True)
    gaps = torch.zeros(n_items, n_cats - 2, requires_grad=True)
    opt = torch.optim.LBFGS([theta, log_alpha, first, gaps], max_iter=max_iter, line_search_fn="strong_wolfe")

    def beta():
        return torch.cat([first, F.softplus(gaps)], 1).cumsum(1)

    def closure():
        opt.zero_grad()
        logp = torch.log_softmax(gpcm_logits(theta[student], log_alpha.exp()[item], beta()[item]), -1)
        loss = (-logp[torch.arange(len(resp)), resp].sum() + 0.5 * (theta**2).sum()
                + 0.5 * (log_alpha**2).sum() / 0.09)
        loss.backward()
        return loss

    for _ in range(rounds):
        opt.step(closure)
    return log_alpha.exp().detach().numpy(), beta().detach().numpy()
