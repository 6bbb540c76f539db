"""Deep Knowledge Tracing (Piech et al. 2015): an LSTM over (question, response) interactions.

The baseline every knowledge-tracing paper reports. Each interaction (q_t, r_t) is embedded as one row of a
table indexed by q_t * K + r_t (the paper's one-hot input of size 2 x skills, as an embedding), an LSTM carries
the learner, and the read-out for question q is the paper's output layer restricted to q:

    P(Y = k | h, q) = softmax_k(l_0 = 0, l_k = w_{q,k} . h + b_{q,k}),   k = 1 .. K-1

so for right/wrong data (K = 2) P(right) = sigmoid(w_q . h + b_q), the paper's per-skill sigmoid. There is no
ability or item parameter: DKT's outputs are probabilities only (use the GPCM families for those).

Streaming contract (streaming.py): the state is the LSTM's (h, c) per layer; step folds one interaction in;
readout answers any questions from the state; forward is the teacher-forced pass (nn.LSTM over the sequence),
whose output at t is readout after stepping through the interactions before t.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DKTConfig:
    n_questions: int  # vocabulary rows incl. padding (0) and unknown (1)
    n_cats: int = 2  # K response categories
    hidden: int = 200  # LSTM size (the paper's 200)
    embed_dim: int = 200  # interaction embedding size
    layers: int = 1
    dropout: float = 0.2  # on the LSTM output before the read-out (training only)

    def __post_init__(self):
        if self.n_questions < 3 or self.n_cats < 2:
            raise ValueError(f"n_questions (incl. padding and unknown) must be >= 3 and n_cats >= 2, got "
                             f"{self.n_questions} and {self.n_cats}")
        if self.hidden < 1 or self.embed_dim < 1 or self.layers < 1:
            raise ValueError("hidden, embed_dim and layers must be positive")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


class DKTOutput(NamedTuple):
    log_probs: torch.Tensor  # (..., K)


class DKT(nn.Module):
    family = "dkt"
    task = "knowledge_tracing"

    def __init__(self, cfg: DKTConfig):
        super().__init__()
        self.cfg = cfg
        K, H = cfg.n_cats, cfg.hidden
        self.interaction = nn.Embedding(cfg.n_questions * K, cfg.embed_dim, padding_idx=0)
        self.lstm = nn.LSTM(cfg.embed_dim, H, num_layers=cfg.layers, batch_first=True)
        self.out_w = nn.Embedding(cfg.n_questions, (K - 1) * H)  # per question: its rows of the output layer
        self.out_b = nn.Embedding(cfg.n_questions, K - 1)
        nn.init.normal_(self.out_w.weight, std=H ** -0.5)
        nn.init.zeros_(self.out_b.weight)
        self.drop = nn.Dropout(cfg.dropout)

    def _read(self, h: torch.Tensor, questions: torch.Tensor) -> DKTOutput:
        """h (B, ..., H) with questions (B, ...) of the same leading shape -> log P(Y = k) (B, ..., K)."""
        K, H = self.cfg.n_cats, self.cfg.hidden
        w = self.out_w(questions).view(*questions.shape, K - 1, H)
        logits = (w @ self.drop(h).unsqueeze(-1)).squeeze(-1) + self.out_b(questions)
        return DKTOutput(torch.log_softmax(F.pad(logits, (1, 0)), dim=-1))

    # -- the streaming contract ------------------------------------------------------------------------
    def state_spec(self) -> list[dict]:
        shape = [self.cfg.layers, self.cfg.hidden]
        return [{"name": "lstm_h", "shape": shape, "dtype": "float32", "init": "zeros"},
                {"name": "lstm_c", "shape": shape, "dtype": "float32", "init": "zeros"}]

    def init_state(self, batch: int = 1) -> tuple[torch.Tensor, ...]:
        shape = (batch, self.cfg.layers, self.cfg.hidden)
        return torch.zeros(shape), torch.zeros(shape)

    def step(self, state, question: torch.Tensor, response: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Fold one interaction (question, response (B,)) into (h, c) (B, layers, H)."""
        h, c = (s.transpose(0, 1).contiguous() for s in state)
        x = self.interaction(question * self.cfg.n_cats + response).unsqueeze(1)
        _, (h, c) = self.lstm(x, (h, c))
        return h.transpose(0, 1), c.transpose(0, 1)

    def readout(self, state, questions: torch.Tensor) -> DKTOutput:
        """questions (B, M) -> log_probs (B, M, K) from the top layer's h; the state is unchanged."""
        top = state[0][:, -1]  # (B, H)
        return self._read(top.unsqueeze(1).expand(-1, questions.shape[1], -1), questions)

    def forward(self, questions: torch.Tensor, responses: torch.Tensor) -> DKTOutput:
        """Teacher-forced: (B, T) -> log_probs (B, T, K), position t from the interactions before t."""
        out, _ = self.lstm(self.interaction(questions * self.cfg.n_cats + responses))  # (B, T, H) after t
        before = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)  # the state before t
        return self._read(before, questions)
