"""The Deep-GPCM family: DKVMN knowledge tracing with an interpretable GPCM output (seed 000).

A learner's knowledge lives in a DKVMN value memory. To predict the response to question q_t the model
reads the memory at q_t's concepts, turns the read-out into an ability theta_t and the question into
a discrimination alpha_t and ordered thresholds beta_t, and gives the Generalized Partial Credit Model

    P(Y_t = k) = softmax_k( sum_{j<k} alpha_t (theta_t - beta_{t,j}) ),   k = 0 .. K-1.

After the response is seen, the interaction (q_t, r_t) is embedded and written into the memory.

Variants
- DeepGPCM: linear-decay ordinal embedding of (q, r) written straight into memory.
- AttentionGPCM: learnable-decay embedding refined by causal windowed self-attention before writing.
- CORALGPCM: DeepGPCM whose GPCM probabilities are blended with CORAL probabilities built on global
  ordered thresholds tau (section 5).

Every variant implements the streaming contract (streaming.py): init_state(B) -> state; step(state, q, r) ->
state; readout(state, q) -> outputs. forward(q, r) is the teacher-forced full-sequence pass used in training;
its output at t is what readout gives after stepping through (q_1, r_1) .. (q_{t-1}, r_{t-1}).
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from .layers.attention import CausalRefinement
from .layers.memory import DKVMN
from .layers.ordinal import CORALBlend, IRTHead, OrdinalResponseEmbedding, gpcm_logits


@dataclass
class GPCMConfig:
    n_questions: int  # rows of the question embedding: vocabulary size incl. padding (0) and unknown (1)
    n_cats: int = 4  # K ordinal categories (2 for right/wrong)
    # Sizes tuned on validation splits (docs/results.md); the seed's defaults were N=50, d_k=50,
    # d_v=200, which fit no better here and cost 5x the time (bench/step_latency.py --sizes seed).
    memory_size: int = 20  # N concepts in the key/value memory
    key_dim: int = 20  # d_k question embedding size
    value_dim: int = 50  # d_v memory slot size
    erase_bias: float = -3.0  # initial erase-gate bias: sigmoid(-3) = 0.05, start by remembering
    summary_dim: int = 50  # width of the summary layer feeding the IRT head
    dropout: float = 0.0  # on the summary layer (early stopping regularises enough here)
    ability_scale: float = 1.0  # theta multiplier (seed: ability_scale)
    ordered_thresholds: bool = True  # beta_0 < beta_1 < ... (seed's flaw: unordered)
    # The seed's summary sees [read; question], which lets theta absorb item difficulty; from memory alone
    # beta stays interpretable (Spearman with the true difficulty 0.92 vs 0.68 on the synthetic set)
    question_in_summary: bool = False
    item_discrimination: bool = False  # alpha from the question alone (IRT) instead of [summary; question]
    # AttentionGPCM only
    embed_dim: int = 64  # interaction embedding size before the value projection
    n_heads: int = 4
    n_cycles: int = 2
    window: int = 64  # attention span W: how many past interactions each position can see


class GPCMOutput(NamedTuple):
    log_probs: torch.Tensor  # (..., K)
    theta: torch.Tensor  # (...)
    alpha: torch.Tensor  # (...)
    beta: torch.Tensor  # (..., K-1)
    cum_logits: torch.Tensor | None = None  # (..., K-1) logits of P(Y > k), CORAL variant only


class DeepGPCM(nn.Module):
    family = "deep_gpcm"
    task = "knowledge_tracing"

    def __init__(self, cfg: GPCMConfig):
        super().__init__()
        self.cfg = cfg
        self.question_embed = nn.Embedding(cfg.n_questions, cfg.key_dim, padding_idx=0)
        self.memory = DKVMN(cfg.memory_size, cfg.key_dim, cfg.value_dim, cfg.erase_bias)
        self.head = IRTHead(cfg.value_dim, cfg.key_dim, cfg.summary_dim, cfg.n_cats, dropout=cfg.dropout,
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

    # -- output ----------------------------------------------------------------------------------------
    def _output(self, read: torch.Tensor, keys: torch.Tensor) -> GPCMOutput:
        theta, alpha, beta = self.head(read, keys)
        return GPCMOutput(torch.log_softmax(gpcm_logits(theta, alpha, beta), dim=-1), theta, alpha, beta)

    # -- streaming API ---------------------------------------------------------------------------------
    def state_spec(self) -> list[dict]:
        """Names, per-entity shapes and dtypes of the state tensors, in the order step() takes them."""
        spec = [{"name": "value_memory", "shape": [self.cfg.memory_size, self.cfg.value_dim],
                 "dtype": "float32", "init": "learned initial value memory"}]
        return spec

    def init_state(self, batch: int = 1) -> tuple[torch.Tensor, ...]:
        return (self.memory.initial(batch).clone(), *self._initial_extra(batch))

    def step(self, state: tuple[torch.Tensor, ...], question: torch.Tensor, response: torch.Tensor):
        """Fold one observed interaction into the state. question, response (B,) int64."""
        memory, extra = state[0], tuple(state[1:])
        weights = self.memory.address(self.question_embed(question))  # (B, N)
        values, extra = self._step_values(extra, question, response)
        erase, add = self.memory.erase_add(values)
        return (self.memory.write(memory, weights, erase, add), *extra)

    def readout(self, state: tuple[torch.Tensor, ...], questions: torch.Tensor) -> GPCMOutput:
        """Answer for questions (B, M) without changing the state; outputs shaped (B, M, ...)."""
        keys = self.question_embed(questions)  # (B, M, dk)
        read = self.memory.read(state[0], self.memory.address(keys))  # (B, M, dv)
        return self._output(read, keys)

    # -- training --------------------------------------------------------------------------------------
    def forward(self, questions: torch.Tensor, responses: torch.Tensor) -> GPCMOutput:
        """Teacher-forced pass. questions, responses (B, T) -> outputs at each t from (q_<t, r_<t) and q_t."""
        keys = self.question_embed(questions)  # (B, T, dk)
        weights = self.memory.address(keys)  # (B, T, N)
        erase, add = self.memory.erase_add(self._values(questions, responses))  # (B, T, dv) each
        memory = self.memory.initial(questions.shape[0])
        reads = []
        for t in range(questions.shape[1]):
            reads.append(self.memory.read(memory, weights[:, t]))
            memory = self.memory.write(memory, weights[:, t], erase[:, t], add[:, t])
        return self._output(torch.stack(reads, dim=1), keys)


class AttentionGPCM(DeepGPCM):
    family = "attention_gpcm"

    def _build_values(self, cfg: GPCMConfig) -> None:
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

    def state_spec(self) -> list[dict]:
        cfg = self.cfg
        return super().state_spec() + [
            {"name": "attention_window", "shape": [cfg.n_cycles, cfg.window, cfg.embed_dim],
             "dtype": "float32", "init": "zeros"},
            {"name": "interaction_count", "shape": [], "dtype": "int64", "init": "zeros"},
        ]


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


MODELS: dict[str, type[DeepGPCM]] = {m.family: m for m in (DeepGPCM, AttentionGPCM, CORALGPCM)}
