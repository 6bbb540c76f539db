"""Ordinal building blocks: response embeddings, the IRT head, GPCM and CORAL probabilities, blending.

Seed 000 sections 1, 4, 5; with the fixes its README asks for:
- the one-hot (Q*K) input times a dense matrix is computed as a weighted sum of K embedding rows;
- thresholds can be kept ordered (beta_0 < beta_1 < ...), and are not squashed into [-1, 1];
- CORAL uses its own global thresholds tau, never the item thresholds beta.
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def linear_decay_weights(n_cats: int) -> torch.Tensor:
    """(K, K) triangular weights w[r, k] = max(0, 1 - |k - r| / (K - 1)): response r also lights up
    its neighbouring categories, so the embedding of a 2 lies between those of a 1 and a 3."""
    k = torch.arange(n_cats, dtype=torch.float32)
    return (1 - (k[None, :] - k[:, None]).abs() / (n_cats - 1)).clamp(min=0)


class OrdinalResponseEmbedding(nn.Module):
    """Embeds an interaction (question q, response r) as sum_k w[r, k] E[k, q].

    Equal to the seed's one-hot (Q*K) vector times a (Q*K, d) matrix, at O(K d) instead of O(Q K d).
    `learnable=False` uses the fixed linear-decay weights; `learnable=True` learns a row-softmax of a
    (K, K) logit matrix initialised at the linear-decay pattern (the seed's learnable decay, generalised
    so each response learns how much to share with its neighbours).
    """

    def __init__(self, n_questions: int, n_cats: int, dim: int, learnable: bool = False):
        super().__init__()
        self.n_questions, self.n_cats = n_questions, n_cats
        self.table = nn.Embedding(n_cats * n_questions, dim)  # row k * Q + q is E[k, q]
        nn.init.normal_(self.table.weight, std=0.1)
        base = linear_decay_weights(n_cats)
        if learnable:
            self.decay_logits = nn.Parameter(torch.log(base + 1e-2))
        else:
            self.register_buffer("fixed_weights", base)
        self.register_buffer("offsets", torch.arange(n_cats) * n_questions)

    def weights(self) -> torch.Tensor:
        if hasattr(self, "decay_logits"):
            return torch.softmax(self.decay_logits, dim=-1)
        return self.fixed_weights

    def forward(self, questions: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """questions, responses (...) int64 -> (..., d)."""
        rows = self.table(questions.unsqueeze(-1) + self.offsets)  # (..., K, d)
        w = self.weights()[responses]  # (..., K)
        return (w.unsqueeze(-1) * rows).sum(-2)


class Thresholds(nn.Module):
    """K-1 thresholds from a feature vector; ordered: b_0 free, b_k = b_{k-1} + softplus(gap_k)."""

    def __init__(self, in_dim: int, n_thresholds: int, ordered: bool):
        super().__init__()
        self.linear = nn.Linear(in_dim, n_thresholds)
        self.ordered = ordered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raw = self.linear(x)
        if not self.ordered:
            return raw
        return torch.cat([raw[..., :1], F.softplus(raw[..., 1:])], dim=-1).cumsum(-1)


def gpcm_logits(theta: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """GPCM category logits Z_0 = 0, Z_k = sum_{j<k} alpha (theta - beta_j).

    theta, alpha (...), beta (..., K-1), broadcast together -> (..., K); softmax over the last axis gives P(Y = k)."""
    steps = alpha.unsqueeze(-1) * (theta.unsqueeze(-1) - beta)  # (..., K-1)
    return F.pad(steps.cumsum(-1), (1, 0))


class IRTHead(nn.Module):
    """Memory read-out and question embedding -> ability theta, discrimination alpha, thresholds beta.

        s     = tanh(W_s [r_t; k_t] + b_s)         summary of what the learner knows about q_t
                (tanh(W_s r_t + b_s) with question_in_summary=False: theta then cannot absorb item
                 difficulty, which keeps beta interpretable)
        theta = (w_theta . s + b) * ability_scale
        alpha = softplus(W_alpha [s; k_t] + b)    > 0  (softplus(W_alpha k_t + b) with item_discrimination:
                                                     a property of the item alone, as in IRT)
        beta  = W_beta k_t + b                    item thresholds, from the question alone
    """

    def __init__(self, read_dim: int, key_dim: int, summary_dim: int, n_cats: int, *,
                 dropout: float, ability_scale: float, ordered_thresholds: bool, question_in_summary: bool,
                 item_discrimination: bool = False):
        super().__init__()
        self.question_in_summary = question_in_summary
        self.item_discrimination = item_discrimination
        in_dim = read_dim + key_dim if question_in_summary else read_dim
        self.summary = nn.Sequential(nn.Linear(in_dim, summary_dim), nn.Tanh(), nn.Dropout(dropout))
        self.ability = nn.Linear(summary_dim, 1)
        self.discrimination = nn.Linear(key_dim if item_discrimination else summary_dim + key_dim, 1)
        self.thresholds = Thresholds(key_dim, n_cats - 1, ordered_thresholds)
        self.ability_scale = ability_scale

    def forward(self, read: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """read (..., dv), keys (..., dk) -> theta (...), alpha (...), beta (..., K-1)."""
        s = self.summary(self._summary_input(read, keys))
        theta = self.ability(s).squeeze(-1) * self.ability_scale
        alpha = F.softplus(self.discrimination(keys if self.item_discrimination else torch.cat([s, keys], -1)))
        alpha = alpha.squeeze(-1)
        return theta, alpha, self.thresholds(keys)

    def ability_of(self, read: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Theta (...) alone, without dropout (as in evaluation) whatever the mode."""
        summary = self.summary[1](self.summary[0](self._summary_input(read, keys)))  # Linear, Tanh: no Dropout
        return self.ability(summary).squeeze(-1) * self.ability_scale

    def _summary_input(self, read: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return torch.cat([read, keys], dim=-1) if self.question_in_summary else read


class CORALBlend(nn.Module):
    """CORAL probabilities from global ordered thresholds tau, blended with GPCM (seed 000 section 5).

    CORAL: P(Y > k) = sigmoid(alpha (theta - delta_q - tau_k)) with delta_q the item's mean threshold
    (detached: CORAL shares the item's location but only tau, global and ordered, shapes its categories).
    Without delta_q the CORAL distribution would be the same for every item of equal alpha, and the
    blend weight never drops below sigmoid(-0.71) = 0.33. tau ordered and alpha > 0 make the cumulative
    probabilities rank-consistent by construction (no clamping pass needed).
    Blend weight w from the geometry of the item's beta (detached, section 7.2) against tau, through the
    bounded transforms (BGT) of section 5.3-5.4; P = (1 - w) P_GPCM + w P_CORAL.
    """

    def __init__(self, n_cats: int):
        super().__init__()
        spread = torch.linspace(-1.0, 1.0, n_cats - 1)
        gaps = torch.log(torch.expm1(spread.diff())) if n_cats > 2 else torch.zeros(0)
        self.tau_raw = nn.Parameter(torch.cat([spread[:1], gaps]))
        self.range_raw = nn.Parameter(torch.zeros(()))  # lambda_R in [0.1, 2.0]
        self.distance_raw = nn.Parameter(torch.zeros(()))  # lambda_D in [0.5, 3.0]
        self.bias_raw = nn.Parameter(torch.zeros(()))  # b_0 in [-1, 1]

    def tau(self) -> torch.Tensor:
        return torch.cat([self.tau_raw[:1], F.softplus(self.tau_raw[1:])]).cumsum(0)

    def blend_weight(self, beta: torch.Tensor) -> torch.Tensor:
        """beta (..., K-1) -> w (...) in (0, 1)."""
        eps = 1e-6
        beta = beta.detach()
        tau = self.tau()
        distance = (tau - beta).abs()
        d_min = distance.min(-1).values
        d_spread = distance.std(-1, unbiased=False)
        r_gpcm = beta.max(-1).values - beta.min(-1).values
        r_coral = tau.max() - tau.min()
        range_div = (r_coral - r_gpcm).abs() / (r_coral + r_gpcm + eps)
        corr = (beta * tau).sum(-1) / (beta.norm(dim=-1) * tau.norm() + eps)
        lam_r = 0.1 + 1.9 * torch.sigmoid(self.range_raw)
        lam_d = 0.5 + 2.5 * torch.sigmoid(self.distance_raw)
        score = (lam_r * 2 * torch.tanh(range_div.clamp(0, 10) / 2)
                 + lam_d * torch.sigmoid(d_min.clamp(-10, 10))
                 + 0.3 * 0.5 * (1 + torch.tanh(corr.clamp(-3, 3)))
                 + 0.1 * torch.exp(-d_spread.clamp(0, 5))
                 + torch.tanh(self.bias_raw))
        return torch.sigmoid(score.clamp(-3, 3))

    def forward(self, theta, alpha, beta, gpcm_log_probs) -> tuple[torch.Tensor, torch.Tensor]:
        """-> blended log-probabilities (..., K) and CORAL cumulative logits (..., K-1)."""
        location = beta.detach().mean(-1, keepdim=True)  # delta_q
        cum_logits = alpha.unsqueeze(-1) * (theta.unsqueeze(-1) - location - self.tau())  # logits of P(Y > k)
        above = torch.sigmoid(cum_logits)
        coral = F.pad(above, (1, 0), value=1.0) - F.pad(above, (0, 1))  # P(Y = k)
        w = self.blend_weight(beta).unsqueeze(-1)
        blended = (1 - w) * gpcm_log_probs.exp() + w * coral.clamp(min=0)
        return torch.log(blended.clamp(min=1e-12)), cum_logits


def _inverse_softplus(x: torch.Tensor) -> torch.Tensor:
    return x + torch.log(-torch.expm1(-x))  # log(exp(x) - 1), stable for large x


class ItemParameters(nn.Module):
    """IRT item parameters from the question embedding alone: alpha = softplus(w . k_t + b) > 0 and ordered
    thresholds beta (Thresholds). What the Bayes ability filter needs: nothing here sees the learner."""

    def __init__(self, key_dim: int, n_cats: int, ordered_thresholds: bool = True):
        super().__init__()
        self.discrimination = nn.Linear(key_dim, 1)
        self.thresholds = Thresholds(key_dim, n_cats - 1, ordered_thresholds)

    def forward(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """keys (..., dk) -> alpha (...), beta (..., K-1)."""
        return F.softplus(self.discrimination(keys)).squeeze(-1), self.thresholds(keys)


@torch.no_grad()
def solve_item_embeddings(embedding: nn.Embedding, rows: torch.Tensor, thresholds: Thresholds,
                          beta: torch.Tensor, discrimination: nn.Linear | None = None,
                          alpha: torch.Tensor | None = None) -> float:
    """Set the question embeddings of `rows` so that the (linear) item heads give the target beta (R, K-1) and,
    with a discrimination head, alpha (R,): the heads' pre-activations are linear in the embedding, so the
    least-squares (minimum-norm) solution hits them exactly whenever dk >= the number of targets.
    Returns the largest error of the result (0 up to rounding)."""
    targets, weights, biases = [], [thresholds.linear.weight], [thresholds.linear.bias]
    if thresholds.ordered:
        gaps = (beta[:, 1:] - beta[:, :-1]).clamp(min=1e-4)
        targets.append(torch.cat([beta[:, :1], _inverse_softplus(gaps)], 1))
    else:
        targets.append(beta)
    if discrimination is not None:
        targets.append(_inverse_softplus(alpha.clamp(min=1e-4)).unsqueeze(1))
        weights.append(discrimination.weight)
        biases.append(discrimination.bias)
    target = torch.cat(targets, 1).double()  # (R, n)
    W, b = torch.cat(weights, 0).double(), torch.cat(biases, 0).double()  # (n, dk), (n,)
    # solved in float64 by numpy's LAPACK, rounded once to the embedding's dtype: the same bits on every run.
    # torch.linalg.lstsq (MKL) rounds after where its workspace lands in memory: in float32 the same system gave
    # solutions ~1e-5 apart from call to call (the demo artifacts differed from build to build), in float64 ones
    # that differ in their last bits
    solution = np.linalg.lstsq(W.numpy(), (target - b).T.numpy(), rcond=None)[0]  # (dk, R)
    embedding.weight[rows] = torch.from_numpy(solution.T).to(embedding.weight.dtype)
    keys = embedding.weight[rows]
    error = (thresholds(keys) - beta).abs().max()
    if discrimination is not None:
        error = torch.maximum(error, (F.softplus(discrimination(keys)).squeeze(-1) - alpha).abs().max())
    return float(error)
