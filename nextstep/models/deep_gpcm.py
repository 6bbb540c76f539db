"""The Deep-GPCM family: DKVMN knowledge tracing with an interpretable GPCM output (seed 000).

A learner's knowledge lives in a DKVMN value memory. To predict the response to question q_t the model
reads the memory at q_t's concepts, turns the read-out into an ability theta_t and the question into
a discrimination alpha_t and ordered thresholds beta_t, and gives the Generalized Partial Credit Model

    P(Y_t = k) = softmax_k( sum_{j<k} alpha_t (theta_t - beta_{t,j}) ),   k = 0 .. K-1.

After the response is seen, the interaction (q_t, r_t) is embedded and written into the memory.

Variants
- DeepGPCM: linear-decay ordinal embedding of (q, r) written straight into memory; with learner_dim > 0 a GRU over
  the same embeddings carries the learner across concepts and its state joins the read-out that gives theta.
- BayesGPCM (deep_gpcm with ability "bayes", its default for ordinal data): the memory holds, per concept, the
  log-likelihood of the responses over a grid of abilities; theta and the prediction come from that posterior.
  Item parameters can start from a fitted IRT model (`warm_start`, irt_init).
- AttentionGPCM: learnable-decay embedding refined by causal windowed self-attention before writing.
- CORALGPCM: DeepGPCM whose GPCM probabilities are blended with CORAL probabilities built on global
  ordered thresholds tau (section 5).

Every variant implements the streaming contract (streaming.py): init_state(B) -> state; step(state, q, r) ->
state; readout(state, q) -> outputs. forward(q, r) is the teacher-forced full-sequence pass used in training;
its output at t is what readout gives after stepping through (q_1, r_1) .. (q_{t-1}, r_{t-1}).
"""

import time
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .layers.attention import CausalRefinement
from .layers.bayes import AbilityGrid
from .layers.irt import fit_gpcm
from .layers.memory import DKVMN
from .layers.ordinal import (
    CORALBlend,
    IRTHead,
    ItemParameters,
    OrdinalResponseEmbedding,
    gpcm_logits,
    solve_item_embeddings,
)


@dataclass
class GPCMConfig:
    n_questions: int  # rows of the question embedding: vocabulary size incl. padding (0) and unknown (1)
    n_cats: int = 4  # K ordinal categories (2 for right/wrong)
    # Sizes tuned on validation splits (docs/results.md); the seed's defaults were N=50, d_k=50,
    # d_v=200, which fit no better here and cost 5x the time (bench/step_latency.py --sizes seed).
    # None: by the data (ORDINAL_DEFAULTS for K > 2, BINARY_DEFAULTS for K = 2)
    memory_size: int | None = None  # N concepts in the key/value memory
    key_dim: int = 20  # d_k question embedding size
    value_dim: int = 50  # d_v memory slot size
    erase_bias: float | None = None  # initial erase-gate bias: sigmoid(-3) = 0.05, start by remembering
    summary_dim: int = 50  # width of the summary layer feeding the IRT head
    dropout: float = 0.0  # on the summary layer (early stopping regularises enough here)
    ability_scale: float = 1.0  # theta multiplier (seed: ability_scale)
    ordered_thresholds: bool = True  # beta_0 < beta_1 < ... (seed's flaw: unordered)
    # The seed's summary sees [read; question], which lets theta absorb item difficulty; from memory alone
    # beta stays interpretable (Spearman with the true difficulty 0.92 vs 0.68 on the synthetic set)
    question_in_summary: bool = False
    # alpha from the question alone (IRT) instead of [summary; question]; None: on for the memory ability on binary
    # data through the deep_gpcm family's builder (with the order penalty it orders P(right), not only theta), off
    # otherwise
    item_discrimination: bool | None = None
    # deep_gpcm only. ability "memory": theta read from the DKVMN value memory; "bayes": each memory slot holds
    # the log-likelihood of the evidence over a grid of theta values, theta the posterior mean (BayesGPCM).
    # None: "bayes" for ordinal data, "memory" for binary (the deep_gpcm family's builder decides, `deep_gpcm`)
    ability: str | None = None
    grid_size: int = 61  # "bayes": theta grid points on [-grid_limit, grid_limit]
    grid_limit: float = 4.5
    # "bayes": None keeps all evidence (a fixed ability, the GPCM generator's assumption); a value in (0, 1) is the
    # initial share of a slot's old evidence kept per write, then learned (an ability that drifts)
    evidence_keep: float | None = None
    # "memory" only: size of a GRU over the interactions that carries the learner across concepts (0: none). Its
    # state before t joins the read-out in the summary, so theta is the ability on q_t's concepts given the whole
    # history, while beta and alpha stay the item's. None: 50 for binary data through the deep_gpcm family's
    # builder (validation AUC 0.810 -> 0.820 on assist2009, docs/results.md), 0 otherwise
    learner_dim: int | None = None
    # warm start: item parameters from a joint-MAP GPCM fit on the fitting students before training
    # (`warm_start`); None: on with the Bayes ability, off with the memory one
    irt_init: bool | None = None
    # "memory" only (deep_gpcm, coral_gpcm): weight of a training penalty on a better answer lowering theta. At every
    # step the model also reads out what each other answer would have given, on the question answered and on the
    # next one, and pays order_penalty * sum_k relu(theta after answer k - theta after answer k+1): without it a
    # right answer gave a lower theta than a wrong one at 7-10% of assist2009's held-out steps (docs/results.md).
    # The Bayes ability is ordered by construction. None: 1.0 for the memory ability on binary data through the
    # deep_gpcm family's builder, 0 otherwise
    order_penalty: float | None = None
    # AttentionGPCM only
    embed_dim: int = 64  # interaction embedding size before the value projection
    n_heads: int = 4
    n_cycles: int = 2
    window: int = 64  # attention span W: how many past interactions each position can see

    def __post_init__(self):
        for name, value in (ORDINAL_DEFAULTS if self.n_cats > 2 else BINARY_DEFAULTS).items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.ability not in (None, "memory", "bayes"):
            raise ValueError(f"ability must be 'memory' or 'bayes', got {self.ability!r}")
        if self.learner_dim is not None and self.learner_dim < 0:
            raise ValueError(f"learner_dim must be 0 (no learner state) or positive, got {self.learner_dim}")
        if self.order_penalty is not None and self.order_penalty < 0:
            raise ValueError(f"order_penalty must be 0 (none) or positive, got {self.order_penalty}")


# Data-dependent defaults, chosen on validation students (docs/results.md): ordinal data (the GPCM synthetic set)
# fit best with one memory slot (one latent trait) that forgets little; binary ASSISTments with 20 concepts.
ORDINAL_DEFAULTS = {"memory_size": 1, "erase_bias": -6.0}
BINARY_DEFAULTS = {"memory_size": 20, "erase_bias": -3.0}


class GPCMOutput(NamedTuple):
    log_probs: torch.Tensor  # (..., K)
    theta: torch.Tensor  # (...)
    alpha: torch.Tensor  # (...)
    beta: torch.Tensor  # (..., K-1)
    cum_logits: torch.Tensor | None = None  # (..., K-1) logits of P(Y > k), CORAL variant only
    # (B, T) training only, with cfg.order_penalty: the weighted penalty at each position, for the loss to add
    order_penalty: torch.Tensor | None = None


class DeepGPCM(nn.Module):
    family = "deep_gpcm"
    task = "knowledge_tracing"

    ability = "memory"  # what cfg.ability None means for this class (BayesGPCM: "bayes")

    def __init__(self, cfg: GPCMConfig):
        super().__init__()
        self.cfg = cfg = _resolve(cfg, self.ability)
        self.question_embed = nn.Embedding(cfg.n_questions, cfg.key_dim, padding_idx=0)
        self.memory = DKVMN(cfg.memory_size, cfg.key_dim, cfg.value_dim, cfg.erase_bias)
        if cfg.learner_dim:
            self.learner = nn.GRU(cfg.value_dim, cfg.learner_dim, batch_first=True)
        self.head = IRTHead(cfg.value_dim + cfg.learner_dim, cfg.key_dim, cfg.summary_dim, cfg.n_cats,
                            dropout=cfg.dropout,
                            ability_scale=cfg.ability_scale, ordered_thresholds=cfg.ordered_thresholds,
                            question_in_summary=cfg.question_in_summary,
                            item_discrimination=cfg.item_discrimination)
        self._build_values(cfg)

    # -- what gets written: overridden by AttentionGPCM ------------------------------------------------
    def _build_values(self, cfg: GPCMConfig) -> None:
        self.response_embed = OrdinalResponseEmbedding(cfg.n_questions, cfg.n_cats, cfg.value_dim)

    def _values(self, questions: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, T, dv) memory write values for a whole sequence."""
        return self.response_embed(questions, responses)

    def _step_values(self, extra: tuple[torch.Tensor, ...], question, response):
        """(B,) -> (B, dv) write value for one step, and the updated non-memory state."""
        return self.response_embed(question, response), extra

    def _initial_extra(self, batch: int) -> tuple[torch.Tensor, ...]:
        return ()

    def _extra_spec(self) -> list[dict]:
        """The state tensors _initial_extra makes, in its order."""
        return []

    # -- output ----------------------------------------------------------------------------------------
    def _output(self, read: torch.Tensor, keys: torch.Tensor) -> GPCMOutput:
        theta, alpha, beta = self.head(read, keys)
        return GPCMOutput(torch.log_softmax(gpcm_logits(theta, alpha, beta), dim=-1), theta, alpha, beta)

    # -- warm start ------------------------------------------------------------------------------------
    def warm_start(self, sequences: list[tuple[np.ndarray, np.ndarray]]) -> dict | None:
        """With cfg.irt_init: fit a GPCM (joint MAP, layers/irt.py) on these (question indices, responses)
        sequences, the run's fitting students, and set the question embeddings so that the item heads give the
        fitted thresholds (and discriminations, where alpha depends on the item alone). Called once before
        training; returns what the manifest records, None without irt_init."""
        if not self.cfg.irt_init:
            return None
        started = time.perf_counter()
        alpha, beta = fit_gpcm([q for q, _ in sequences], [r for _, r in sequences], self.cfg.n_questions,
                               self.cfg.n_cats)
        rows = torch.arange(1, self.cfg.n_questions)  # every row but padding
        head = self.head  # IRTHead or, for BayesGPCM, ItemParameters: both have .thresholds and .discrimination
        item_alpha = isinstance(head, ItemParameters) or self.cfg.item_discrimination
        error = solve_item_embeddings(self.question_embed, rows, head.thresholds, torch.from_numpy(beta[1:]),
                                      head.discrimination if item_alpha else None,
                                      torch.from_numpy(alpha[1:]) if item_alpha else None)
        return {"irt_init": {"items": len(rows), "alpha": item_alpha, "max_error": error,
                             "seconds": round(time.perf_counter() - started, 1)}}

    # -- streaming API ---------------------------------------------------------------------------------
    def state_spec(self) -> list[dict]:
        """Names, per-entity shapes and dtypes of the state tensors, in the order step() takes them."""
        spec = [{"name": "value_memory", "shape": [self.cfg.memory_size, self.cfg.value_dim],
                 "dtype": "float32", "init": "learned initial value memory"}, *self._extra_spec()]
        if self.cfg.learner_dim:  # the last state tensor, after the subclass's extras
            spec.append({"name": "learner_state", "shape": [self.cfg.learner_dim], "dtype": "float32",
                         "init": "zeros"})
        return spec

    def init_state(self, batch: int = 1) -> tuple[torch.Tensor, ...]:
        memory = self.memory.initial(batch).clone()
        learner = (memory.new_zeros(batch, self.cfg.learner_dim),) if self.cfg.learner_dim else ()
        return (memory, *self._initial_extra(batch), *learner)

    def _split(self, state: tuple[torch.Tensor, ...]):
        """state -> (value memory, a subclass's extra tensors, the learner state or None)."""
        if self.cfg.learner_dim:
            return state[0], tuple(state[1:-1]), state[-1]
        return state[0], tuple(state[1:]), None

    def step(self, state: tuple[torch.Tensor, ...], question: torch.Tensor, response: torch.Tensor):
        """Fold one observed interaction into the state. question, response (B,) int64."""
        memory, extra, learner = self._split(state)
        weights = self.memory.address(self.question_embed(question))  # (B, N)
        values, extra = self._step_values(extra, question, response)
        erase, add = self.memory.erase_add(values)
        memory = self.memory.write(memory, weights, erase, add)
        if learner is None:
            return (memory, *extra)
        _, learner = self.learner(values.unsqueeze(1), learner.unsqueeze(0).contiguous())  # (1, B, H)
        return (memory, *extra, learner.squeeze(0))

    def readout(self, state: tuple[torch.Tensor, ...], questions: torch.Tensor) -> GPCMOutput:
        """Answer for questions (B, M) without changing the state; outputs shaped (B, M, ...)."""
        memory, _, learner = self._split(state)
        keys = self.question_embed(questions)  # (B, M, dk)
        read = self.memory.read(memory, self.memory.address(keys))  # (B, M, dv)
        if learner is not None:
            read = torch.cat([read, learner.unsqueeze(1).expand(-1, questions.shape[1], -1)], -1)
        return self._output(read, keys)

    # -- training --------------------------------------------------------------------------------------
    def forward(self, questions: torch.Tensor, responses: torch.Tensor) -> GPCMOutput:
        """Teacher-forced pass. questions, responses (B, T) -> outputs at each t from (q_<t, r_<t) and q_t.
        Training with cfg.order_penalty also fills `order_penalty` (see `counterfactual_theta`)."""
        keys = self.question_embed(questions)  # (B, T, dk)
        weights = self.memory.address(keys)  # (B, T, N)
        values = self._values(questions, responses)  # (B, T, dv)
        erase, add = self.memory.erase_add(values)  # (B, T, dv) each
        memory = self.memory.initial(questions.shape[0])
        ordered = self.training and self.cfg.order_penalty > 0
        if ordered:  # what counterfactual_theta needs from the memory before each write, read in the same bmm
            following = torch.cat([weights[:, 1:], torch.zeros_like(weights[:, :1])], 1)  # w_{t+1}
            rows = torch.stack([weights, weights * weights, following, following * weights], 2)  # (B, T, 4, N)
        reads = []
        for t in range(questions.shape[1]):
            reads.append(self.memory.read(memory, rows[:, t] if ordered else weights[:, t]))
            memory = self.memory.write(memory, weights[:, t], erase[:, t], add[:, t])
        read = torch.stack(reads, dim=1)  # (B, T, dv), or (B, T, 4, dv) with the counterfactuals' reads
        before = None
        if self.cfg.learner_dim:  # the GRU's state before t: zeros, then its output after t-1
            after, _ = self.learner(values)
            before = torch.cat([torch.zeros_like(after[:, :1]), after[:, :-1]], 1)
        out = self._output(self._with_learner(read[:, :, 0] if ordered else read, before), keys)
        if ordered:
            same, following_theta = self.counterfactual_theta(questions, keys, weights, following, read, before)
            penalty = _disorder(same) + torch.nn.functional.pad(_disorder(following_theta)[:, :-1], (1, 0))
            out = out._replace(order_penalty=self.cfg.order_penalty * penalty)
        return out

    def _with_learner(self, read: torch.Tensor, learner: torch.Tensor | None) -> torch.Tensor:
        return read if learner is None else torch.cat([read, learner], -1)

    def counterfactual_theta(self, questions, keys, weights, following, reads, before):
        """Theta after each possible answer at every step, from the teacher-forced pass's tensors: (B, T, K) on the
        question answered (q_t) and (B, T, K) on the next one (q_{t+1}; the last step's is meaningless).

        The write is linear in the memory, so reading the memory after a counterfactual write of erase e and add a
        with weights u needs only reads of the memory before it: read(M', u) = read(M, u) - e * read(M, u w_t) +
        (u . w_t) a. `reads` (B, T, 4, dv) holds read(M, w_t), read(M, w_t w_t), read(M, w_{t+1}),
        read(M, w_{t+1} w_t); the learner state takes one GRU step from `before` (B, T, H). Theta is the head's
        without dropout, as served."""
        B, T = questions.shape
        following_keys = torch.cat([keys[:, 1:], keys[:, :1]], 1)
        on_same = (weights * weights).sum(-1, keepdim=True)  # (B, T, 1)
        on_following = (following * weights).sum(-1, keepdim=True)
        same, nxt = [], []
        for k in range(self.cfg.n_cats):
            values = self.response_embed(questions, torch.full_like(questions, k))  # (B, T, dv)
            erase, add = self.memory.erase_add(values)
            read_same = reads[:, :, 0] - erase * reads[:, :, 1] + on_same * add
            read_following = reads[:, :, 2] - erase * reads[:, :, 3] + on_following * add
            learner = None
            if before is not None:
                learner, _ = self.learner(values.reshape(B * T, 1, -1), before.reshape(1, B * T, -1).contiguous())
                learner = learner.reshape(B, T, -1)
            same.append(self.head.ability_of(self._with_learner(read_same, learner), keys))
            nxt.append(self.head.ability_of(self._with_learner(read_following, learner), following_keys))
        return torch.stack(same, -1), torch.stack(nxt, -1)


class AttentionGPCM(DeepGPCM):
    family = "attention_gpcm"

    def _build_values(self, cfg: GPCMConfig) -> None:
        if cfg.order_penalty:  # an answer's value here depends on the answers before it, which the penalty does not see
            raise ValueError("order_penalty is for deep_gpcm and coral_gpcm, not attention_gpcm")
        self.response_embed = OrdinalResponseEmbedding(cfg.n_questions, cfg.n_cats, cfg.embed_dim, learnable=True)
        self.refine = CausalRefinement(cfg.embed_dim, cfg.n_heads, cfg.n_cycles, cfg.window)
        self.value_proj = nn.Linear(cfg.embed_dim, cfg.value_dim)

    def _values(self, questions, responses):
        return self.value_proj(self.refine(self.response_embed(questions, responses)))

    def _step_values(self, extra, question, response):
        windows, count = extra
        refined, windows, count = self.refine.step(windows, count, self.response_embed(question, response))
        return self.value_proj(refined), (windows, count)

    def _initial_extra(self, batch):
        return self.refine.initial(batch)

    def _extra_spec(self) -> list[dict]:
        cfg = self.cfg
        return [{"name": "attention_window", "shape": [cfg.n_cycles, cfg.window, cfg.embed_dim],
                 "dtype": "float32", "init": "zeros"},
                {"name": "interaction_count", "shape": [], "dtype": "int64", "init": "zeros"}]


class CORALGPCM(DeepGPCM):
    family = "coral_gpcm"

    def __init__(self, cfg: GPCMConfig):
        super().__init__(cfg)
        self.coral = CORALBlend(cfg.n_cats)

    def _output(self, read, keys):
        theta, alpha, beta = self.head(read, keys)
        gpcm = torch.log_softmax(gpcm_logits(theta, alpha, beta), dim=-1)
        log_probs, cum_logits = self.coral(theta, alpha, beta, gpcm)
        return GPCMOutput(log_probs, theta, alpha, beta, cum_logits)


class BayesGPCM(DeepGPCM):
    """deep_gpcm with ability "bayes" (the default for ordinal data): theta tracked by a Bayes filter.

    The item side is DeepGPCM's (question embedding -> alpha, ordered beta, the item alone); the learner side is
    no longer a learned value memory but, per DKVMN concept slot, the summed log-likelihood of the responses seen
    over a fixed grid of abilities (layers/bayes.py). The prediction is the posterior predictive, theta the
    posterior mean: for one slot and fixed items exactly the Bayes-optimal causal predictor, so training fits the
    item parameters by their marginal likelihood. With memory_size > 1 the key memory addresses the slots as in
    DKVMN. value_dim, summary_dim, erase_bias and dropout do not apply. The state keeps the name value_memory:
    (N, grid_size) evidence, zeros at the start, kept within [-FLOOR, 0] of each slot's best grid point
    (AbilityGrid.add_evidence) so that float32 rounding stays small.
    """

    ability = "bayes"

    def __init__(self, cfg: GPCMConfig):
        nn.Module.__init__(self)
        self.cfg = cfg = _resolve(cfg, self.ability)
        self.question_embed = nn.Embedding(cfg.n_questions, cfg.key_dim, padding_idx=0)
        if cfg.memory_size > 1:  # one slot needs no addressing
            self.key_memory = nn.Parameter(torch.empty(cfg.memory_size, cfg.key_dim))
            nn.init.kaiming_normal_(self.key_memory)
            self.query = nn.Linear(cfg.key_dim, cfg.key_dim)
        self.head = ItemParameters(cfg.key_dim, cfg.n_cats, cfg.ordered_thresholds)
        self.grid = AbilityGrid(cfg.grid_size, cfg.grid_limit)
        if cfg.evidence_keep is not None:
            self.keep_logit = nn.Parameter(torch.logit(torch.tensor(float(cfg.evidence_keep))))

    def _keep(self) -> torch.Tensor | None:
        return torch.sigmoid(self.keep_logit) if self.cfg.evidence_keep is not None else None

    def _address(self, keys: torch.Tensor) -> torch.Tensor:
        """(..., dk) -> (..., N) slot weights (DKVMN addressing)."""
        if self.cfg.memory_size == 1:
            return torch.ones_like(keys[..., :1])
        return torch.softmax(torch.tanh(self.query(keys)) @ self.key_memory.t(), dim=-1)

    def _items(self, keys: torch.Tensor):
        alpha, beta = self.head(keys)
        return alpha, beta, self.grid.item_log_probs(alpha, beta)  # (...), (..., K-1), (..., G, K)

    def _predict(self, evidence, alpha, beta, item_lp) -> GPCMOutput:
        log_probs, theta = self.grid.predict(evidence, item_lp)
        return GPCMOutput(log_probs, theta, alpha, beta)

    def state_spec(self) -> list[dict]:
        return [{"name": "value_memory", "shape": [self.cfg.memory_size, self.cfg.grid_size], "dtype": "float32",
                 "init": "zeros (no evidence: the prior)"}]

    def init_state(self, batch: int = 1) -> tuple[torch.Tensor, ...]:
        return (torch.zeros(batch, self.cfg.memory_size, self.cfg.grid_size, device=self.grid.grid.device),)

    def step(self, state, question, response):
        keys = self.question_embed(question)  # (B, dk)
        _, _, item_lp = self._items(keys)  # (B, G, K)
        ll = item_lp.gather(-1, response.view(-1, 1, 1).expand(-1, item_lp.shape[1], 1)).squeeze(-1)  # (B, G)
        return (self.grid.add_evidence(state[0], self._address(keys), ll, self._keep()),)

    def readout(self, state, questions):
        keys = self.question_embed(questions)  # (B, M, dk)
        evidence = torch.bmm(self._address(keys), state[0])  # (B, M, G)
        return self._predict(evidence, *self._items(keys))

    def for_serving(self) -> "BayesGPCM":
        """This model for export (training/export.py): a form whose step and readout look the item side up (every
        question's slot weights, alpha, beta and log P(k | theta_g) on the grid: none of it sees the learner) in
        tables made from these weights now, instead of computing it from the question embedding at every call. The
        same function (the export harness checks its stepping against `forward`, <= 1e-5) in about half the ONNX
        Runtime time of a served event (bench/kt_graph_ab.py). Past TABLE_LIMIT floats, the model itself."""
        cfg = self.cfg
        if cfg.n_questions * (cfg.n_cats * cfg.grid_size + cfg.memory_size + cfg.n_cats) > TABLE_LIMIT:
            return self
        return TabulatedBayesGPCM(self)

    def forward(self, questions, responses):
        keys = self.question_embed(questions)  # (B, T, dk)
        weights = self._address(keys)  # (B, T, N)
        alpha, beta, item_lp = self._items(keys)  # (B, T, G, K)
        ll = item_lp.gather(-1, responses[..., None, None].expand(*responses.shape, item_lp.shape[2], 1))
        ll = ll.squeeze(-1)  # (B, T, G)
        memory, keep = self.init_state(questions.shape[0])[0], self._keep()
        evidence = []
        for t in range(questions.shape[1]):  # the same recursion as step, so the two agree to the last bit
            evidence.append(torch.bmm(weights[:, t:t + 1], memory))  # (B, 1, G)
            memory = self.grid.add_evidence(memory, weights[:, t], ll[:, t], keep)
        return self._predict(torch.cat(evidence, 1), alpha, beta, item_lp)


# floats of item tables (8 MiB; about 8,400 questions at K = 4 with the ordinal defaults) past which a BayesGPCM is
# exported computing its item side: an artifact holds the tables about five times (step, predict and step_predict in
# ONNX, step and predict in TorchScript) and the service's sessions about as many times in memory, per version loaded
TABLE_LIMIT = 1 << 21


class TabulatedBayesGPCM(BayesGPCM):
    """A BayesGPCM whose item side is looked up (BayesGPCM.for_serving): per question row, the slot weights (Q, N),
    alpha and beta (Q, K) and log P(k | theta_g) (Q, K x G: response k's G values at k x G). The step adds the
    response's G values; the readout sums the posterior times P(k | theta_g) over each response's G values (one
    matmul with a 0/1 matrix, in linear space, in place of BayesGPCM's logsumexp over (G, K) terms). It shares the
    model's parameters (its state dict is the model's: the tables are not in it), and the tables are made once:
    weights changed afterwards (training on, a state dict loaded) leave them stale, so a form is made for each export
    and used for nothing else. `forward` is the model's own pass, against which the export harness checks this
    stepping."""

    def __init__(self, model: BayesGPCM):
        nn.Module.__init__(self)
        self.cfg = model.cfg
        for name, child in model.named_children():
            setattr(self, name, child)
        for name, parameter in model.named_parameters(recurse=False):
            self.register_parameter(name, parameter)
        with torch.no_grad():
            keys = model.question_embed(torch.arange(model.cfg.n_questions, device=model.question_embed.weight.device))
            alpha, beta, item_lp = model._items(keys)  # (Q), (Q, K-1), (Q, G, K)
            tables = {"weights": model._address(keys), "items": torch.cat([alpha.unsqueeze(-1), beta], -1),
                      "log_lik": item_lp.transpose(1, 2).flatten(1)}
        K, G, device = model.cfg.n_cats, model.cfg.grid_size, keys.device
        tables["grid_index"] = torch.arange(G, device=device)  # response k's values in a row: k * G + grid_index
        tables["segments"] = torch.eye(K, device=device).repeat_interleave(G, 0)  # (K x G, K): sums each k's G terms
        for name, table in tables.items():
            self.register_buffer(name, table.contiguous(), persistent=False)
        self.train(model.training)

    def step(self, state, question, response):
        ll = F.embedding(question, self.log_lik).gather(1, response.unsqueeze(1) * self.cfg.grid_size + self.grid_index)
        return (self.grid.add_evidence(state[0], F.embedding(question, self.weights), ll, self._keep()),)  # ll (B, G)

    def readout(self, state, questions):
        evidence = torch.bmm(F.embedding(questions, self.weights), state[0])  # (B, M, G)
        post = torch.softmax(self.grid.log_prior + evidence, -1)
        terms = F.embedding(questions, self.log_lik).exp() * post.repeat(1, 1, self.cfg.n_cats)  # (B, M, K x G)
        items = F.embedding(questions, self.items)  # (B, M, K): alpha, beta
        return GPCMOutput((terms @ self.segments).log(), post @ self.grid.grid, items[..., 0], items[..., 1:])


def _disorder(theta: torch.Tensor) -> torch.Tensor:
    """(..., K) theta after each answer -> (...) sum_k relu(theta_k - theta_{k+1}): how far a better answer falls."""
    return torch.relu(theta[..., :-1] - theta[..., 1:]).sum(-1)


def _resolve(cfg: GPCMConfig, ability: str) -> GPCMConfig:
    """The config a class builds from: ability None -> the class's own; irt_init None -> on with "bayes"."""
    if cfg.ability not in (None, ability):
        raise ValueError(f"ability {cfg.ability!r}: {ability!r} is the only one this model class has"
                         + (" (build deep_gpcm through `deep_gpcm(cfg)`)" if cfg.ability == "bayes" else ""))
    if ability == "bayes" and cfg.learner_dim:
        raise ValueError("learner_dim applies to the memory ability only: the Bayes filter's ability is its posterior")
    if ability == "bayes" and cfg.order_penalty:
        raise ValueError("order_penalty applies to the memory ability only: the Bayes filter's is ordered already")
    return replace(cfg, ability=ability, irt_init=(ability == "bayes") if cfg.irt_init is None else cfg.irt_init,
                   learner_dim=cfg.learner_dim or 0, item_discrimination=bool(cfg.item_discrimination),
                   order_penalty=cfg.order_penalty or 0.0)


BINARY_LEARNER_DIM = 50  # deep_gpcm's learner state for right/wrong data, chosen on validation (docs/results.md)
# and its order penalty, with the item's own discrimination: a right answer never lowers theta or P(right)
BINARY_ORDER = {"order_penalty": 1.0, "item_discrimination": True}


def deep_gpcm(cfg: GPCMConfig) -> DeepGPCM:
    """The deep_gpcm family's model (its registry entry): the Bayes ability filter for ordinal data (K > 2) or
    when cfg.ability says "bayes", the DKVMN memory read-out otherwise, with a GRU learner state, the order penalty
    and the item's own discrimination for binary data unless cfg.learner_dim (cfg.order_penalty,
    cfg.item_discrimination) says otherwise."""
    ability = cfg.ability or ("bayes" if cfg.n_cats > 2 else "memory")
    binary_memory = ability == "memory" and cfg.n_cats == 2
    learner = cfg.learner_dim
    if learner is None:
        learner = BINARY_LEARNER_DIM if binary_memory else 0
    order = {k: v for k, v in BINARY_ORDER.items() if getattr(cfg, k) is None} if binary_memory else {}
    return (BayesGPCM if ability == "bayes" else DeepGPCM)(replace(cfg, ability=ability, learner_dim=learner,
                                                                   **order))


def restore(name: str, config: dict, weights: dict) -> DeepGPCM:
    """The deep_gpcm model of an artifact's weights.pt (its registry restorer). A config written before the Bayes
    ability existed has no "ability" key and was a memory read-out, whatever its K; one written before the learner
    state has no "learner_dim" and had none; one written before the order penalty has no "order_penalty" (it was not
    trained with one), while "item_discrimination" was always written."""
    config = {"learner_dim": 0, "order_penalty": 0.0, **config}
    if "ability" not in config:
        config = {**config, "ability": "memory"}
    model = deep_gpcm(GPCMConfig(**config))
    model.load_state_dict(weights)
    return model


MODELS: dict[str, type[DeepGPCM]] = {"deep_gpcm": DeepGPCM, "deep_gpcm_bayes": BayesGPCM,
                                     "attention_gpcm": AttentionGPCM, "coral_gpcm": CORALGPCM}
