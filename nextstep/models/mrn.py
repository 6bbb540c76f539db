"""MRN, the modular reasoning network of seed 004, as a streaming next-item model.

Symbols and their discrete states
    Item row j has a real embedding E_j in R^n (the only learned table besides an item bias) and the
    discrete state x_j = round(E_j) mod m in Z_m^n. Forward is exactly that; backward is a
    straight-through estimator: x = hard + (E - sg(E)) (sg: stop-gradient), so dx/dE = 1 and the
    forward value is the exact integer (E - sg(E) is exactly 0). Every later "mod m" is the same kind of
    STE: (a mod m) + (a - sg(a)).

Exact match and its surrogate
    match(q, x) = sum_i 1(q_i = x_i) = <C(q), C(x)>, with C(q) in {0,1}^{n x m} the one-hot code of each
    coordinate, so the match of a query against every item is one matrix product. For gradients the code
    is C(q) = onehot(q) + g(q) - sg(g(q)) with g(q)_{i,v} = exp(-d(q_i, v)^2 / (2 sigma^2)) and d the
    circular difference on Z_m (wrapped to [-m/2, m/2)): the forward pass is the exact (hard) match,
    the backward pass is the gradient of the smooth match sum_i sum_v g(q)_{iv} g(x)_{iv}, i.e. a
    Gaussian kernel of the circular difference q_i - x_i. (Hard forward everywhere, also in training.)

Streaming state per session
    history (L, n)  the last L discrete states, row 0 the most recent: H_t = [x_t, x_{t-1}, ...]
    context (n,)    c_{t+1} = (A c_t + B x_{t+1}) mod m, A and B fixed integer matrices in Z_m^{n x n}
                    drawn from `seed` (buffers); c_0 = 0. Its recursion carries no gradient (only the
                    B x_{t+1} term does, scaled by 1/(m n)), so that A^t cannot blow gradients up.
    count ()        events folded in so far (int64); history rows k >= count are padding (masked)

Scores after x_t (the current state), over every item row j
    Paths p = 1..P: h_p = H_t[p-1] for the K most recent states that exist (p - 1 < count), plus
    h_{K+1} = c_t when use_context. For each path (two-step derivation):
        z1_p = (x_t + h_p) mod m
        v_p  = best(z1_p) = argmax_{j >= 2} match(z1_p, x_j)     (ties: the lowest row)
        m1_p = match(z1_p, x_{v_p})
        z2_p = (x_{v_p} + h_p) mod m
        m2_pj = match(z2_p, x_j)
    Path weights: w = softmax over the existing paths of alpha * m1_p / n (alpha = 0: the plain mean;
    a constant alpha * m1 added to every candidate, as in the seed's score alpha*m1 + beta*m2, would
    not change any ranking or probability, so the intermediate match acts as a path confidence).
    Repeat channel (an addition to the seed; weight gamma, 0 turns it off): R_j = 1 if
    match(H_t[l], x_j) = n for some l < min(L, count), i.e. x_j equals one of the last L states (an item
    clicked in the last L events, or one whose state collides with it exactly), else 0. An indicator: it
    carries no gradient. With repeat_learned the channel is a learned weight per window position instead,
    summed over the positions whose state equals x_j: gamma * R_j becomes sum_{l < min(L, count)} gamma_l
    1(x_j = H_t[l]) (gamma_l starts at `repeat`; an item clicked twice in the window collects both).
        S_j = beta * sum_p w_p m2_pj / n + gamma * R_j
        score_j = S_j / tau + sum_h head_h(state)_j + b_j,          P(j) = softmax over rows j >= 2 of score_j
    b_j is a learned per-item bias (use_bias; it breaks the many ties of integer matches and carries
    popularity). head_h are the plug-in heads named in `heads` (HEADS at the end of this file; none by
    default): each adds a learned term computed from the streaming state and the items' codes, e.g. the
    transition head's learned match between the current state and x_j. Before any event (count = 0)
    score_j = b_j. Rows 0 and 1 are never recommended.

Measured (rsc15_100k; tuned on *_train_tr / *_train_valid, 4 epochs unless said; Recall@20 / MRR@20):
    n=32 m=8 tau=0.2 sigma=1.0, no repeat channel      0.182 / 0.081
    same + repeat gamma=0.5                             0.335 / 0.227   (sigma 0.5: 0.321 / 0.210;
        + alpha=2 and the context path: 0.327 / 0.224; + contrastive 0.1: 0.334 / 0.235; n=64: 0.352 / 0.243)
    gamma=1.0 (tau 0.2) or gamma=0.5 with tau 0.1       0.397 / 0.277, 0.393 / 0.279   (gamma=2.0: 0.367 / 0.268;
        n=64: 0.400 / 0.279 at 2.5x the time; 8 epochs: 0.396 / 0.280)
    test, configs/mrn_rsc15.json (8 epochs, 231 s):     0.393 / 0.281; popularity 0.089 / 0.026, Markov 0.591 /
        0.343, GRU4Rec ~0.67 / 0.36. The derivation alone is only about twice popularity; with the item bias
        no ties remain at the target (tie group 1), and scoring that model without its derivation loses
        only 0.008 Recall@20: the repeat channel and the bias carry it.
    Issue 18 (validation Markov: 0.525 / 0.312), 12 epochs unless said:
        + transition head rank 64 (4 epochs) / rank 128       0.462 / 0.297, 0.510 / 0.289   (n=64 m=16 with
            rank 128, 8 epochs: 0.371 / 0.203 at twice the time)
        + repeat_learned                                    0.537 / 0.277   (transition window 8: 0.521 / 0.303)
        + lr_final 0.1: configs/mrn_rsc15_transition.json   0.582 / 0.330   (window 8: 0.586 / 0.328;
                                                                             16 epochs: 0.585 / 0.320)
        The ablations of that configuration and its test figures (3 seeds) are in docs/results.md.

forward(items (B, T)) computes the same quantities for every prefix at once (row t sees items[:, :t+1]
only); it equals stepping, which the tests check.
"""

import copy
from dataclasses import dataclass, replace

import torch
from torch import nn

from .next_item import RESERVED, NextItemModel


@dataclass
class MRNConfig:
    n_items: int  # rows, including padding and unknown
    dim: int = 32  # n
    modulus: int = 8  # m
    history: int = 8  # L, the window
    parallel: int = 3  # K <= L, derivation paths from the most recent states
    alpha: float = 0.0  # path confidence: weight of the intermediate match m1
    beta: float = 1.0  # weight of the final match m2
    temperature: float = 0.2  # tau (chosen on the rsc15_100k validation split)
    # The next three: None takes the mrn family's default through its builder (`mrn`, FAMILY_DEFAULTS) and the
    # seed's design in MRN itself (SEED_DESIGN: no repeat channel, no heads)
    repeat: float | None = None  # gamma, the repeat channel; 0 is the seed's model
    repeat_learned: bool | None = None  # one learned gamma_l per window position l (initial value: repeat), summed
    use_context: bool = False  # the context vector as one more derivation path
    use_bias: bool = True  # learned item bias b_j
    sigma: float = 1.0  # width of the surrogate kernel (in units of Z_m; 1.0 beat 0.5 on validation)
    init_spread: float = 1.0  # E ~ U[0, m * init_spread)
    seed: int = 0  # A, B and the embeddings
    heads: dict | None = None  # plug-in heads added to the score: {name in HEADS: options}

    def __post_init__(self):
        if self.n_items < 3:
            raise ValueError(f"n_items counts padding and unknown rows, so it must be at least 3, got {self.n_items}")
        for name in ("dim", "history", "parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.modulus < 2:
            raise ValueError(f"modulus must be at least 2, got {self.modulus}")
        if self.parallel > self.history:
            raise ValueError(f"parallel (K={self.parallel}) cannot exceed history (L={self.history})")
        if self.temperature <= 0 or self.sigma <= 0:
            raise ValueError("temperature and sigma must be positive")
        unknown = set(self.heads or {}) - set(HEADS)
        if unknown:
            raise ValueError(f"unknown MRN heads {sorted(unknown)}; expected some of {sorted(HEADS)}")


def ste(hard: torch.Tensor, soft: torch.Tensor) -> torch.Tensor:
    """Forward exactly `hard`, backward the gradient of `soft` (soft - sg(soft) is exactly zero)."""
    return hard + (soft - soft.detach()) if soft.requires_grad else hard


def mod_ste(a: torch.Tensor, m: int) -> torch.Tensor:
    return ste(torch.remainder(a.detach(), m), a)


class MRN(NextItemModel):
    family = "mrn"

    def __init__(self, cfg: MRNConfig):
        super().__init__()
        cfg = _filled(cfg, SEED_DESIGN)
        self.cfg = cfg
        self.n_items = cfg.n_items
        n, m = cfg.dim, cfg.modulus
        g = torch.Generator().manual_seed(cfg.seed)
        self.E = nn.Parameter(torch.rand(cfg.n_items, n, generator=g) * (m * cfg.init_spread))
        self.bias = nn.Parameter(torch.zeros(cfg.n_items)) if cfg.use_bias else None
        self.register_buffer("A", torch.randint(0, m, (n, n), generator=g).float())
        self.register_buffer("B", torch.randint(0, m, (n, n), generator=g).float())
        self.register_buffer("levels", torch.arange(m).float())
        blocked = torch.zeros(cfg.n_items)
        blocked[:RESERVED] = float("-inf")
        self.register_buffer("blocked", blocked)
        self.gamma = nn.Parameter(torch.full((cfg.history,), float(cfg.repeat))) if cfg.repeat_learned else None
        self.heads = nn.ModuleDict({name: HEADS[name](cfg, **options) for name, options in cfg.heads.items()})
        self.k_active, self.l_active = cfg.parallel, cfg.history  # the curriculum lowers these in training

    # ---- discrete states, codes, matches -------------------------------------------------------------
    def states(self) -> torch.Tensor:
        """x = round(E) mod m for every row (V, n), with the straight-through gradient to E."""
        return ste(torch.remainder(torch.round(self.E.detach()), self.cfg.modulus), self.E)

    def code(self, x: torch.Tensor) -> torch.Tensor:
        """(..., n) states -> (..., n * m) one-hot codes; in training with the kernel's gradient."""
        hard = (x.detach().unsqueeze(-1) == self.levels).to(x.dtype)
        if x.requires_grad:
            m = self.cfg.modulus
            d = x.unsqueeze(-1) - self.levels
            d = d - m * torch.round(d.detach() / m)  # circular difference, wrapped to [-m/2, m/2]
            hard = ste(hard, torch.exp(-d * d / (2 * self.cfg.sigma ** 2)))
        return hard.flatten(-2)

    def match(self, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Elementwise match of two (..., n) state tensors -> (...), exact forward, surrogate backward."""
        return (self.code(q) * self.code(x)).sum(-1)

    # ---- streaming API -------------------------------------------------------------------------------
    def state_spec(self) -> list[dict]:
        n, L = self.cfg.dim, self.cfg.history
        return [{"name": "history", "shape": [L, n], "dtype": "float32"},
                {"name": "context", "shape": [n], "dtype": "float32"},
                {"name": "count", "shape": [], "dtype": "int64"}]

    def init_state(self, batch: int) -> tuple[torch.Tensor, ...]:
        n, L = self.cfg.dim, self.cfg.history
        return torch.zeros(batch, L, n), torch.zeros(batch, n), torch.zeros(batch, dtype=torch.int64)

    def _context(self, c: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        m, n = self.cfg.modulus, self.cfg.dim
        a = c.detach() @ self.A.t() + x.detach() @ self.B.t()
        soft = x @ self.B.t() / (m * n) if x.requires_grad else a
        return ste(torch.remainder(a, m), soft)

    def step(self, state, items):
        history, context, count = state
        x = self.states()[items]
        history = torch.cat([x.unsqueeze(1), history[:, :-1]], 1)
        return history, self._context(context, x), count + 1

    def scores(self, state):
        history, context, count = state
        return self._score(history, context, count)

    def forward(self, items: torch.Tensor) -> torch.Tensor:
        B, T = items.shape
        L, n = self.cfg.history, self.cfg.dim
        xs = self.states()[items]  # (B, T, n)
        padded = torch.cat([xs.new_zeros(B, L - 1, n), xs], 1)  # history row l at t is xs[t - l]
        history = torch.stack([padded[:, L - 1 - l:L - 1 - l + T] for l in range(L)], 2)  # (B, T, L, n)
        contexts, c = [], xs.new_zeros(B, n)
        for t in range(T):
            c = self._context(c, xs[:, t])
            contexts.append(c)
        count = torch.arange(1, T + 1, device=items.device).expand(B, T)
        hits = None
        if self.cfg.repeat:  # the same indicator via item rows: rows with identical states form one class
            L_act = min(self.l_active, L)
            with torch.no_grad():
                _, cls = torch.unique(self.E.detach().round().remainder(self.cfg.modulus), dim=0, return_inverse=True)
                rows = torch.cat([items.new_zeros(B, L_act - 1), items], 1)
                rows = torch.stack([rows[:, L_act - 1 - l:L_act - 1 - l + T] for l in range(L_act)], 2)  # (B, T, L)
                seen = (torch.arange(L_act) <= torch.arange(T).view(T, 1)).to(xs.dtype)  # (T, L): t - l >= 0
            if self.gamma is not None:  # sum over the window of gamma_l for each position whose class is j's
                marks = xs.new_zeros(B, T, int(cls.max()) + 1).scatter_add(
                    2, cls[rows], (seen * self.gamma[:L_act]).expand(B, T, L_act))
                hits = marks.gather(2, cls.expand(B, T, -1))
            else:
                with torch.no_grad():
                    marks = xs.new_zeros(B, T, int(cls.max()) + 1)
                    marks.scatter_add_(2, cls[rows], seen.expand(B, T, L_act))
                    hits = (marks.gather(2, cls.expand(B, T, -1)) > 0).to(xs.dtype)  # (B, T, V) in {0, 1}
        return self._score(history, torch.stack(contexts, 1), count, hits)

    # ---- the derivation, over any leading shape ------------------------------------------------------
    def _score(self, history: torch.Tensor, context: torch.Tensor, count: torch.Tensor,
               hits: torch.Tensor | None = None) -> torch.Tensor:
        """history (..., L, n), context (..., n), count (...) -> scores (..., V). hits: the repeat
        indicator R (..., V) when the caller has it already."""
        cfg = self.cfg
        m, n = cfg.modulus, cfg.dim
        K, L = min(self.k_active, cfg.history), min(self.l_active, cfg.history)
        X = self.states()
        CX = self.code(X)  # (V, n m)
        x_t = history[..., 0, :]
        paths = history[..., :K, :]
        exists = torch.arange(K, device=count.device) < count.unsqueeze(-1)  # (..., K)
        if cfg.use_context:
            paths = torch.cat([paths, context.unsqueeze(-2)], -2)
            exists = torch.cat([exists, (count > 0).unsqueeze(-1)], -1)
        z1 = mod_ste(x_t.unsqueeze(-2) + paths, m)  # (..., P, n)
        with torch.no_grad():
            m1_all = self.code(z1.detach()) @ CX.detach().t() + self.blocked  # (..., P, V)
            v = m1_all.argmax(-1)
        x_v = X[v]  # (..., P, n), gradient to E rows v
        m1 = self.match(z1, x_v)  # (..., P)
        z2 = mod_ste(x_v + paths, m)
        m2 = self.code(z2) @ CX.t()  # (..., P, V)
        exists_f = exists.to(m2.dtype)
        w = torch.softmax(cfg.alpha * m1 / n + (exists_f - 1.0) * 1e9, -1) * exists_f  # 0 for all paths absent
        S = cfg.beta * (w.unsqueeze(-1) * m2).sum(-2) / n
        if cfg.repeat:
            if hits is None:
                with torch.no_grad():
                    seen = torch.arange(L, device=count.device) < count.unsqueeze(-1)  # (..., L)
                    same = (self.code(history[..., :L, :].detach()) @ CX.detach().t()) == n  # (..., L, V)
                    marks = (same & seen.unsqueeze(-1)).to(S.dtype)
                hits = (marks * self.gamma[:L].unsqueeze(-1)).sum(-2) if self.gamma is not None else marks.amax(-2)
            S = S + (hits if self.gamma is not None else cfg.repeat * hits)
        out = S / cfg.temperature  # rows 0/1 get a finite score too; readout() and ranking skip them
        for head in self.heads.values():
            out = out + head(self.code, history, context, count, CX)
        return out if self.bias is None else out + self.bias


# ---- plug-in heads ---------------------------------------------------------------------------------------
# A head adds a learned term to every item's score: head(code, history (..., L, n), context (..., n), count (...),
# CX (V, n m) the items' codes) -> (..., V), with code the model's MRN.code (states -> one-hot codes, with the
# surrogate gradient in training). It sees only the streaming state, so stepping and the full pass
# agree and nothing after position t reaches row t. `heads` in MRNConfig names them with their options.


class TransitionHead(nn.Module):
    """A learned match between the current states and every item's state x_j:

        q   = sum_{l < w, l < count} a_l C(H_t[l]) U          (a_0 = 1 and the others 0 at the start)
        T_j = <q, C(x_j) W> / sqrt(d)                         (0 before the first event)

    with C the one-hot code of Z_m^n (n m columns), U, W in R^{(n m) x d} and a_l learned window weights
    (w = `window` most recent states; w = 1: the last state only). The exact match is the special case
    U W^T = I (match(x_t, x_j)), and match((x_t + h) mod m, x_j) is U W^T = the permutation shifting each
    coordinate's value by h_i; a learned U W^T of rank d lets each (coordinate, value) of the current state
    vote for (coordinate, value) pairs of the next one, which is what a first-order Markov chain counts, here
    over the discrete states. Gradients reach E through the codes' surrogate, as in the derivation."""

    def __init__(self, cfg: MRNConfig, rank: int = 64, init: float = 0.1, window: int = 1):
        super().__init__()
        if rank < 1 or not 1 <= window <= cfg.history:
            raise ValueError(f"rank must be at least 1 and window in [1, history], got {rank}, {window}")
        g = torch.Generator().manual_seed(cfg.seed + 1)
        width = cfg.dim * cfg.modulus
        self.U = nn.Parameter(torch.randn(width, rank, generator=g) * init)
        self.W = nn.Parameter(torch.randn(width, rank, generator=g) * init)
        self.a = nn.Parameter(torch.eye(1, window).squeeze(0)) if window > 1 else None
        self.window, self.scale = window, rank ** -0.5

    def forward(self, code, history, context, count, CX):
        if self.a is None:
            query = code(history[..., 0, :]) @ self.U
        else:
            seen = (torch.arange(self.window, device=count.device) < count.unsqueeze(-1)).to(CX.dtype)
            query = ((seen * self.a).unsqueeze(-1) * code(history[..., :self.window, :])).sum(-2) @ self.U
        return (query @ (CX @ self.W).t()) * self.scale * (count > 0).unsqueeze(-1).to(CX.dtype)


HEADS: dict[str, type[nn.Module]] = {"transition": TransitionHead}


# ---- the family's defaults -------------------------------------------------------------------------------
# MRNConfig's repeat, repeat_learned and heads left None: the seed's design in MRN itself; in the mrn family
# (`nextstep train mrn`) the setting validated on rsc15_100k in issue 18 (configs/mrn_rsc15_transition.json:
# test Recall@20 / MRR@20 0.643 / 0.347 against the seed design's 0.277 / 0.137 and Markov's 0.591 / 0.343).
# configs/mrn_seed.json trains the seed's design alone.
SEED_DESIGN = {"repeat": 0.0, "repeat_learned": False, "heads": {}}
FAMILY_DEFAULTS = {"repeat": 1.0, "repeat_learned": True, "heads": {"transition": {"rank": 128}}}


def _filled(cfg: MRNConfig, values: dict) -> MRNConfig:
    """cfg with its None fields among `values` set from them."""
    missing = {k: copy.deepcopy(v) for k, v in values.items() if getattr(cfg, k) is None}
    return replace(cfg, **missing) if missing else cfg


def mrn(cfg: MRNConfig) -> MRN:
    """The mrn family's model (its registry entry): FAMILY_DEFAULTS for the fields left None (a repeat channel
    turned off, repeat 0, has no learned weights either)."""
    defaults = dict(FAMILY_DEFAULTS, **({"repeat_learned": False} if cfg.repeat == 0 else {}))
    return MRN(_filled(cfg, defaults))


def restore(name: str, config: dict, weights: dict) -> MRN:
    """The MRN of an artifact's weights.pt (its registry restorer). Its config names every field, but one written
    before repeat_learned and heads existed lacks them, and was trained without either: a key missing there is
    the seed's design, never the family's default."""
    model = MRN(MRNConfig(**{**SEED_DESIGN, **config}))
    model.load_state_dict(weights)
    return model
