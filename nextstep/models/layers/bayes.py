"""Ability as a Bayes filter: a posterior over a fixed grid of theta values, updated with the GPCM likelihood.

For one latent trait and known item parameters, the best causal predictor of the next response is the posterior
predictive under the exact posterior of theta given the responses so far. On a grid theta_1 .. theta_G:

    log p(theta_g | r_<t) = log N(theta_g; 0, 1) + E_t(g) - log Z,   E_t(g) = sum_{s<t} log P(r_s | theta_g, item s)
    P(Y_t = k)            = sum_g p(theta_g | r_<t) P(k | theta_g, alpha_t, beta_t)
    theta_t (read out)    = sum_g p(theta_g | r_<t) theta_g                          the posterior mean

With several concepts (a DKVMN key memory), each slot i keeps its own evidence, written with the question's
attention weight w_s(i) (E_i += w_s(i) log P(r_s | .)) and read with the query's, E = sum_i w_t(i) E_i: one slot
is the exact filter; several let evidence about one concept count less for another.

Each slot's evidence is stored relative to its best grid point and floored FLOOR nats below it: the posterior
is unchanged by the shift, and by the floor only at points weighted below e^-FLOOR of the mode; without it a
few hundred responses drive the extreme points to -1e3 or more, where float32 keeps only ~1e-4 absolute.
"""

import torch
from torch import nn

from .ordinal import gpcm_logits

FLOOR = 40.0  # nats below a slot's best grid point


class AbilityGrid(nn.Module):
    def __init__(self, grid_size: int = 61, limit: float = 4.5):
        super().__init__()
        grid = torch.linspace(-limit, limit, grid_size)
        self.register_buffer("grid", grid)
        self.register_buffer("log_prior", torch.log_softmax(-0.5 * grid**2, 0))  # N(0, 1) on the grid
        self.limit = limit

    def item_log_probs(self, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
        """alpha (...), beta (..., K-1) -> log P(k | theta_g) (..., G, K)."""
        logits = gpcm_logits(self.grid, alpha.unsqueeze(-1), beta.unsqueeze(-2))  # broadcast to (..., G, K)
        return torch.log_softmax(logits, -1)

    @staticmethod
    def add_evidence(memory: torch.Tensor, weights: torch.Tensor, log_lik: torch.Tensor,
                     keep: torch.Tensor | None = None) -> torch.Tensor:
        """memory (B, N, G) evidence, weights (B, N) slot weights, log_lik (B, G) of the response -> the new
        memory, shifted so each slot's maximum is 0 and floored at -FLOOR. keep (a scalar in (0, 1]): a slot's
        old evidence is first scaled by 1 - w (1 - keep), so evidence fades as the slot is written (ability
        that drifts: learning); None keeps all of it (a fixed ability)."""
        w = weights.unsqueeze(-1)  # (B, N, 1)
        if keep is not None:
            memory = memory * (1 - w * (1 - keep))
        memory = memory + w * log_lik.unsqueeze(1)
        return (memory - memory.max(-1, keepdim=True).values).clamp(min=-FLOOR)

    def predict(self, evidence: torch.Tensor, item_log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """evidence (..., G), item_log_probs (..., G, K) -> posterior-predictive log P(k) (..., K), theta (...)."""
        log_post = torch.log_softmax(self.log_prior + evidence, -1)
        theta = (log_post.exp() * self.grid).sum(-1)
        return torch.logsumexp(log_post.unsqueeze(-1) + item_log_probs, -2), theta
