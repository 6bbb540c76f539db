"""DTransformer's attention blocks: multi-head attention with causal masks and monotonic distance decay.

Blocks 1-3 (questions, interactions, their mix) use AKT's context-aware decay: with softmax weights a_tj
over the visible keys, the distance of key j from query t is d_tj = sqrt(|t - j| * sum_{j' > j} a_tj'),
the score is multiplied by exp(-|gamma_h| d_tj) (clamped to [1e-5, 1e5]), and the distance is computed
without gradient, as in AKT and DTransformer.

Block 4 (the knowledge read-out) asks the same `n_know` learned queries at every position, so its scores do
not depend on the query position: only the mask does. With a decay that is linear in the distance,
exp(s_j - g_h (t - j)), every row is a prefix sum over keys, computed by a chunked scan instead of a
(T x T) attention per knowledge query (DTransformer expands the batch n_know times for that). The scan keeps
a running maximum so float32 neither overflows nor loses a row's nearest keys. docs/decisions.md has the
reasoning.

A row with no visible key (position 0 of a strictly causal block) outputs zeros.

Streaming (SimAKT's cached state): a row of blocks 1-3 needs only its own query and the keys and values of
the rows it sees, so `Block.row` adds one row against cached keys; block 4's read-out at the next position is
a running, rescaled weighted mean over the rows so far (`KnowledgeReadout.running`, `add`, `finish`).
"""

import math

import torch
from torch import nn

MAX_KNOW_DECAY = 2.0  # block 4's per-head decay rate g_h is clamped to [0, 2]
MAX_WINDOW = 256  # the longest sequence block 4 is used on (SimAKTConfig checks its window)


def visible(rows: torch.Tensor, T: int, peek_current: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Query positions `rows` (...) against keys 0..T-1 -> (mask (..., T): query t sees key j iff j <= t
    (peek_current) or j < t; the distance |t - j| (..., T) as a float)."""
    gap = rows[..., None] - torch.arange(T, device=rows.device)
    return (gap >= 0 if peek_current else gap > 0), gap.abs().float()


def causal(T: int, peek_current: bool, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, distance), each (T, T), of a whole sequence: `visible` for every position."""
    return visible(torch.arange(T, device=device), T, peek_current)


class DecayAttention(nn.Module):
    """Multi-head attention with shared query/key projection (DTransformer's kq_same) and AKT decay."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        assert d_model % n_heads == 0, "d_model must be divisible by n_heads"
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        self.qk = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)
        self.gamma = nn.Parameter(torch.empty(n_heads, 1, 1))
        nn.init.xavier_uniform_(self.gamma)

    def heads(self, x: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
        B, T, _ = x.shape
        return proj(x).view(B, T, self.n_heads, self.d_head).transpose(1, 2)  # (B, H, T, dh)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, gap: torch.Tensor,
               heads: list[int] | None = None) -> torch.Tensor:
        """q (B, H, R, dh) against k, v (B, H, T, dh); mask and gap |t - j| broadcast to (B, H, R, T) (`visible`)
        -> per-head outputs (B, H, R, dh). `heads`: which of the block's heads q, k, v hold (default all)."""
        return self.weights(q @ k.transpose(-1, -2) / math.sqrt(self.d_head), mask, gap, heads) @ v

    def weights(self, scores: torch.Tensor, mask: torch.Tensor, gap: torch.Tensor, heads: list[int] | None = None
                ) -> torch.Tensor:
        """Scaled scores (B, H, R, T) -> the decayed attention weights (B, H, R, T) (module docstring)."""
        with torch.no_grad():
            weights = torch.softmax(scores.masked_fill(~mask, -1e32), dim=-1)
            # attention on keys after j: a reversed cumulative sum, shifted (no subtraction, so no cancellation)
            after = torch.nn.functional.pad(weights.flip(-1).cumsum(-1).flip(-1)[..., 1:], (0, 1))
            distance = (after * gap).clamp(min=0.0).sqrt()
        gamma = self.gamma if heads is None else self.gamma[heads]
        effect = (-gamma.abs() * distance).exp().clamp(1e-5, 1e5)
        scores = (scores * effect).masked_fill(~mask, -1e32)
        return torch.softmax(scores, dim=-1).masked_fill(~mask, 0.0)  # rows with no key: all zero

    def merge(self, heads: torch.Tensor) -> torch.Tensor:
        B, H, T, dh = heads.shape
        return self.out(heads.transpose(1, 2).reshape(B, T, H * dh))


class Block(nn.Module):
    """One DTransformer layer: decayed attention, dropout, residual, layer norm."""

    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.attn = DecayAttention(d_model, n_heads)
        self.dropout = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, peek_current: bool) -> torch.Tensor:
        a = self.attn
        mask, gap = causal(query.shape[1], peek_current, query.device)
        out = a.merge(a.attend(a.heads(query, a.qk), a.heads(key, a.qk), a.heads(value, a.v), mask, gap))
        return self.norm(query + self.dropout(out))

    def row(self, x: torch.Tensor, parts: list, at: torch.Tensor) -> torch.Tensor:
        """One new row per sequence (causal, the row sees itself): x (N, d) at position at (N,), whose keys and
        values at positions 0..T-1 (its own among them) are projections of sums of table rows, sum_i c_i
        table_i[rows_i] (parts: [(table (V, d), rows (N, T), c (N, T, 1) or None)]). Linear, so per table the
        query meets its V projected rows once and the scores are gathered per position, and the values are the
        projected rows weighted by the attention summed per table row: O(T + V d) a head instead of O(T d)
        (the projected tables are constants of the weights: ONNX Runtime folds them)."""
        a, N = self.attn, x.shape[0]
        H, dh, T = a.n_heads, a.d_head, parts[0][1].shape[1]
        q = a.qk(x).view(N, H, dh)
        scores = (q * a.qk.bias.view(H, dh)).sum(-1, keepdim=True)  # (N, H, 1): the keys' bias
        for table, rows, c in parts:
            s = torch.einsum("nhd,vhd->nhv", q, (table @ a.qk.weight.T).view(-1, H, dh))
            s = s.gather(2, rows[:, None].expand(N, H, T))
            scores = scores + (s if c is None else s * c.view(N, 1, T))
        mask, gap = visible(at[:, None, None], T, True)  # (N, 1, 1, T)
        w = a.weights(scores[:, :, None] / math.sqrt(dh), mask, gap)[:, :, 0]  # (N, H, T)
        out = w.sum(-1, keepdim=True) * a.v.bias.view(H, dh)  # the values' bias
        for table, rows, c in parts:
            per_row = w.new_zeros(N, H, table.shape[0]).scatter_add(2, rows[:, None].expand(N, H, T),
                                                                     w if c is None else w * c.view(N, 1, T))
            out = out + torch.einsum("nhv,vhd->nhd", per_row, (table @ a.v.weight.T).view(-1, H, dh))
        return self.norm(x + self.dropout(a.out(out.reshape(N, H * dh))))


class KnowledgeReadout(nn.Module):
    """Block 4: `n_know` learned knowledge queries attend to the mixed states of earlier positions.

    z[b, t, k] = LayerNorm(know_k + W_o concat_h sum_{j < t} w_hj v_hj / sum_{j < t} w_hj),
    w_hj = exp(s_hkj - g_h (t - j)), s_hkj = (W know_k)_h . (W hq_j)_h / sqrt(dh): keys up to t - 1, so z_t
    knows responses before t only."""

    def __init__(self, d_model: int, n_heads: int, n_know: int, dropout: float):
        super().__init__()
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        self.know = nn.Parameter(torch.empty(n_know, d_model))
        nn.init.xavier_uniform_(self.know)
        self.qk = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)
        self.rate = nn.Parameter(torch.full((n_heads,), 0.1))
        self.dropout = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(d_model)

    CHUNK = 16  # keys per step of the scan in forward

    def _terms(self, hq: torch.Tensor, p: torch.Tensor):
        """Log-weights l = s_hkj + g_h j (B, K, H, T) and values (B, 1, H, T, dh); exp(-g_h t) cancels per row."""
        B, T, d = hq.shape
        H, dh = self.n_heads, self.d_head
        q = self.qk(self.know).view(-1, H, dh)  # (K, H, dh)
        k = self.qk(hq).view(B, T, H, dh)
        v = self.v(p).view(B, T, H, dh).permute(0, 2, 1, 3)  # (B, H, T, dh)
        scores = torch.einsum("khd,bthd->bkht", q, k) / math.sqrt(dh)  # (B, K, H, T)
        pos = torch.arange(T, device=hq.device, dtype=hq.dtype)
        return scores + self.rate.clamp(0.0, MAX_KNOW_DECAY)[:, None] * pos, v.unsqueeze(1)

    def _finish(self, mixed: torch.Tensor) -> torch.Tensor:
        """mixed (B, K, H, R, dh) -> z (B, R, K, d)."""
        B, K, H, R, dh = mixed.shape
        out = self.out(mixed.permute(0, 3, 1, 2, 4).reshape(B, R, K, H * dh))
        return self.norm(self.know + self.dropout(out))

    def forward(self, hq: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """Every position: hq, p (B, T, d) -> z (B, T, K, d).

        A scan over chunks of CHUNK keys: each chunk's weights are taken relative to the running maximum of
        the log-weights so far (so nothing overflows in float32 and a row's nearest keys never underflow:
        within a chunk the log-weights differ from that maximum by at most the score spread plus g_h CHUNK),
        exclusive prefix sums within the chunk, plus the rescaled sums of the chunks before."""
        logits, v = self._terms(hq, p)
        T = logits.shape[-1]
        outs, num, den, ref = [], None, None, None
        for c0 in range(0, T, self.CHUNK):
            lc, vc = logits[..., c0:c0 + self.CHUNK], v[..., c0:c0 + self.CHUNK, :]
            top = lc.amax(-1, keepdim=True).detach()
            new_ref = top if ref is None else torch.maximum(ref, top)
            w = (lc - new_ref).exp()  # (B, K, H, c)
            wv = w.unsqueeze(-1) * vc  # (B, K, H, c, dh)
            pn = torch.cat([torch.zeros_like(wv[:, :, :, :1]), wv[:, :, :, :-1].cumsum(3)], 3)  # keys j < t
            pd = torch.cat([torch.zeros_like(w[..., :1]), w[..., :-1].cumsum(-1)], -1)
            if num is None:
                num, den = wv.sum(3), w.sum(-1, keepdim=True)
            else:
                scale = (ref - new_ref).exp()  # (B, K, H, 1)
                carried_num, carried_den = num * scale, den * scale
                pn = pn + carried_num.unsqueeze(3)
                pd = pd + carried_den
                num, den = carried_num + wv.sum(3), carried_den + w.sum(-1, keepdim=True)
            ref = new_ref
            outs.append(pn / pd.clamp(min=1e-30).unsqueeze(-1))  # a row with no key: 0 / tiny = 0
        return self._finish(torch.cat(outs, 3))

    EMPTY = -1e30  # the running maximum of a sequence without rows: exp(EMPTY - l) is 0

    def running(self, hq: torch.Tensor, p: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The read-out's running state after rows 0..length[b]-1 of hq, p (B, T, d): (mix (B, K, H, dh + 1): the
        weighted mean of the values so far and, last, the total weight relative to top; top (B, K, H): the
        largest log-weight). A mean, not a sum, so that its size does not grow with the rows."""
        logits, v = self._terms(hq, p)
        T = hq.shape[1]
        seen = torch.arange(T, device=hq.device)[None, :] < length[:, None]  # (B, T)
        logits = logits.masked_fill(~seen[:, None, None, :], self.EMPTY)
        top = logits.amax(-1)
        w = (logits - top.unsqueeze(-1)).exp() * seen[:, None, None, :].to(logits.dtype)  # (B, K, H, T)
        total = w.sum(-1, keepdim=True)
        return torch.cat([(w.unsqueeze(-1) * v).sum(3) / total.clamp(min=1e-30), total], -1), top

    def add(self, mix: torch.Tensor, top: torch.Tensor, hq: torch.Tensor, p: torch.Tensor, at: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Fold one row hq, p (N, d) at position at (N,) into the running state (`running`): afterwards it reads
        out position at + 1. The total weight is rescaled when the row raises the maximum."""
        N, H, dh = hq.shape[0], self.n_heads, self.d_head
        q = self.qk(self.know).view(-1, H, dh)  # (K, H, dh)
        logit = torch.einsum("khd,nhd->nkh", q, self.qk(hq).view(N, H, dh)) / math.sqrt(dh) \
            + self.rate.clamp(0.0, MAX_KNOW_DECAY) * at[:, None, None].to(hq.dtype)  # (N, K, H)
        new_top = torch.maximum(top, logit)
        w = (logit - new_top).exp().unsqueeze(-1)
        total = mix[..., -1:] * (top - new_top).exp().unsqueeze(-1) + w
        mean = mix[..., :-1] + (self.v(p).view(N, 1, H, dh) - mix[..., :-1]) * (w / total)
        return torch.cat([mean, total], -1), new_top

    def finish(self, mix: torch.Tensor) -> torch.Tensor:
        """Running state (B, K, H, dh + 1) -> z (B, 1, K, d); no rows yet: the mix is 0."""
        return self._finish(mix[..., :-1].unsqueeze(3))
