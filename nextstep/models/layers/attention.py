"""Causal, windowed multi-head self-attention refinement of interaction embeddings (AttentionGPCM).

Seed 000 section 3, made causal: position t attends to positions t-W+1 .. t only, so nothing a learner
does later can change an earlier embedding. Each cycle c maps h^c to h^(c+1):

    a_t     = MHA(h^c_t; h^c_{t-W+1..t})
    f_t     = W_f [h^c_t; a_t] + b_f
    g_t     = sigmoid(W_g h^c_t + b_g)
    h^(c+1) = LayerNorm(g_t * f_t + (1 - g_t) * h^c_t)

For streaming, the state keeps the last W inputs of every cycle, (B, C, W, d), plus how many
interactions were seen; `step` appends one position and attends over the window exactly as the
full-sequence pass does with its band mask.
"""

import math

import torch
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        assert dim % n_heads == 0, "embed_dim must be divisible by n_heads"
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, queries: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """queries (B, Tq, d), keys (B, Tk, d), allowed (B or 1, Tq, Tk) bool -> (B, Tq, d)."""
        B, Tq, d = queries.shape
        Tk = keys.shape[1]
        H, hd = self.n_heads, self.head_dim
        w_q, w_k, w_v = self.qkv.weight.split(d)
        b_q, b_k, b_v = self.qkv.bias.split(d)
        q = (queries @ w_q.t() + b_q).view(B, Tq, H, hd).transpose(1, 2)  # (B, H, Tq, hd)
        k = (keys @ w_k.t() + b_k).view(B, Tk, H, hd).transpose(1, 2)
        v = (keys @ w_v.t() + b_v).view(B, Tk, H, hd).transpose(1, 2)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)  # (B, H, Tq, Tk)
        scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
        attended = torch.softmax(scores, dim=-1) @ v  # (B, H, Tq, hd)
        return self.out(attended.transpose(1, 2).reshape(B, Tq, d))


class RefinementCycle(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.attention = CausalSelfAttention(dim, n_heads)
        self.fusion = nn.Linear(2 * dim, dim)
        self.gate = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, queries: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        attended = self.attention(queries, keys, allowed)
        fused = self.fusion(torch.cat([queries, attended], dim=-1))
        g = torch.sigmoid(self.gate(queries))
        return self.norm(g * fused + (1 - g) * queries)


class CausalRefinement(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_cycles: int, window: int):
        super().__init__()
        self.cycles = nn.ModuleList(RefinementCycle(dim, n_heads) for _ in range(n_cycles))
        self.window, self.dim = window, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, d) -> (B, T, d); position t sees positions max(0, t-W+1) .. t."""
        T = x.shape[1]
        t = torch.arange(T, device=x.device)
        lag = t[:, None] - t[None, :]
        allowed = ((lag >= 0) & (lag < self.window)).unsqueeze(0)  # (1, T, T)
        for cycle in self.cycles:
            x = cycle(x, x, allowed)
        return x

    def initial(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty windows (B, C, W, d) and interaction count (B,)."""
        device = self.cycles[0].gate.weight.device
        windows = torch.zeros(batch, len(self.cycles), self.window, self.dim, device=device)
        return windows, torch.zeros(batch, dtype=torch.int64, device=device)

    def step(self, windows: torch.Tensor, count: torch.Tensor, x: torch.Tensor):
        """windows (B, C, W, d), count (B,), x (B, d) -> refined x (B, d), windows', count'."""
        count = count + 1
        slot = torch.arange(self.window, device=x.device)
        # after the shift the newest entry sits in slot W-1; the last min(count, W) slots are real
        allowed = (slot.unsqueeze(0) >= self.window - count.unsqueeze(1)).unsqueeze(1)  # (B, 1, W)
        new_windows = []
        h = x.unsqueeze(1)  # (B, 1, d)
        for c, cycle in enumerate(self.cycles):
            keys = torch.cat([windows[:, c, 1:], h], dim=1)  # (B, W, d)
            new_windows.append(keys)
            h = cycle(h, keys, allowed)
        return h.squeeze(1), torch.stack(new_windows, dim=1), count
