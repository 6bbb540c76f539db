"""DKVMN memory: a static key memory that addresses concepts and a per-entity value memory.

Zhang et al., "Dynamic Key-Value Memory Networks for Knowledge Tracing" (WWW 2017); seed 000 section 2.

    w_t   = softmax(tanh(W_q k_t + b_q) M_k^T)            attention of question t over N concepts
    r_t   = sum_i w_t(i) M_v(i)                           read
    e_t   = sigmoid(W_e v_t + b_e), a_t = tanh(W_a v_t + b_a)
    M_v(i) <- M_v(i) * (1 - w_t(i) e_t) + w_t(i) a_t      erase-add write

Addressing depends on the question only and erase/add on the interaction only, so the full-sequence
pass computes both for all t at once and only the read and the write stay inside the time loop.
"""

import torch
from torch import nn


class DKVMN(nn.Module):
    def __init__(self, memory_size: int, key_dim: int, value_dim: int, erase_bias: float = -3.0):
        super().__init__()
        self.key_memory = nn.Parameter(torch.empty(memory_size, key_dim))  # (N, dk), static concepts
        self.init_value_memory = nn.Parameter(torch.empty(memory_size, value_dim))  # (N, dv)
        nn.init.kaiming_normal_(self.key_memory)
        nn.init.normal_(self.init_value_memory, std=0.1)
        self.query = nn.Linear(key_dim, key_dim)
        self.erase = nn.Linear(value_dim, value_dim)
        self.add = nn.Linear(value_dim, value_dim)
        # start by remembering: sigmoid(-3) = 0.05 erases little, so evidence accumulates from the first
        # epoch; the model still learns to forget where learners change
        nn.init.constant_(self.erase.bias, erase_bias)

    def address(self, keys: torch.Tensor) -> torch.Tensor:
        """(..., dk) question embeddings -> (..., N) attention weights over the concepts."""
        return torch.softmax(torch.tanh(self.query(keys)) @ self.key_memory.t(), dim=-1)

    def erase_add(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(..., dv) interaction values -> erase in [0, 1] and add in [-1, 1], both (..., dv)."""
        return torch.sigmoid(self.erase(values)), torch.tanh(self.add(values))

    def initial(self, batch: int) -> torch.Tensor:
        """(B, N, dv) the learned initial value memory, one copy per entity."""
        return self.init_value_memory.unsqueeze(0).expand(batch, -1, -1)

    @staticmethod
    def read(memory: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """memory (B, N, dv), weights (B, N) or (B, M, N) -> (B, dv) or (B, M, dv)."""
        if weights.dim() == 2:
            return torch.bmm(weights.unsqueeze(1), memory).squeeze(1)
        return torch.bmm(weights, memory)

    @staticmethod
    def write(memory: torch.Tensor, weights: torch.Tensor, erase: torch.Tensor, add: torch.Tensor) -> torch.Tensor:
        """memory (B, N, dv), weights (B, N), erase and add (B, dv) -> updated memory (B, N, dv)."""
        w = weights.unsqueeze(-1)  # (B, N, 1)
        return memory * (1 - w * erase.unsqueeze(1)) + w * add.unsqueeze(1)
