"""One GRU4Rec training step with its gradients written out by hand.

A training step is small (32 sessions, 100 hidden units, 544 scored columns) and the hidden state is
detached after every step (one-step truncated backpropagation, as in the official code), so the whole
backward pass is a dozen matrix products. Autograd spent more time recording and replaying the graph
and building sparse gradients than on that arithmetic; this step computes the same gradients directly
(about 1.2x the events per second of the autograd version; docs/results.md). The model's own forward
pass (`GRU4Rec.advance`, `scores`) remains the definition: tests/training/next_item/test_gru4rec_step.py checks these
gradients against autograd through it for every input mode, depth, dropout and loss.

Losses on the step's score matrix O (row b, positive in column b):
  cross-entropy  -log softmax(O_b)_b, after the caller's logQ correction of each column (gru4rec_loop.LogQ:
                 log count for an in-batch target, alpha * log count for a sampled negative);
  bpr            mean over negatives j of -log sigmoid(O_bb - O_bj);
  bpr-max        -log sum_j s_bj sigmoid(O_bb - O_bj) + bpreg * sum_j s_bj O_bj^2, with s_b the softmax
                 over the negatives (Hidasi & Karatzoglou 2018), computed in log space (no log(0)).
The step reports the loss summed over the mini-batch; its gradients are those of that sum divided by the
configured batch size, as in the official code. The scale is not cancelled by Adagrad: eps sits inside
its square root, sqrt(acc + eps), so the scale decides how much eps damps small gradients (summed
instead of averaged, validation Recall@20 fell by 0.011; docs/decisions.md).

GRU (PyTorch's gate order r, z, n), for one layer with input x and previous state h:
    r = σ(a_r), z = σ(a_z), a = gi + gh with gi = W_ih x + b_ih, gh = W_hh h + b_hh
    n = tanh(gi_n + r ⊙ gh_n),  h' = (1 − z) ⊙ n + z ⊙ h,  y = h' ⊙ mask (hidden dropout)
and its backward, given dL/dy (h is a constant: the state was detached):
    dn = dh' ⊙ (1 − z) ⊙ (1 − n²),  dz = dh' ⊙ (h − n) ⊙ z(1 − z),  dr = dn ⊙ gh_n ⊙ r(1 − r)
    dgi = [dr, dz, dn],  dgh = [dr, dz, dn ⊙ r],  dW_ih = dgiᵀ x,  dW_hh = dghᵀ h,  dx = dgi W_ih.
Scores O = y Wᵀ + b over the step's columns, minus each column's logQ correction; for cross-entropy
dO = softmax(O) − I, for the other losses dO comes from autograd on O alone (a two-node graph).

Dense gradients land in `.grad` of the GRU weights; the item tables get coalesced sparse gradients
(each row once, duplicates summed), which is what `AdagradM` consumes.
"""

import torch
import torch.nn.functional as F

from ...models.gru4rec import GRU4Rec

LOSSES = ("cross-entropy", "bpr", "bpr-max")


class TrainStep:
    """Forward and backward of one session-parallel step; the optimiser step is the caller's."""

    def __init__(self, model: GRU4Rec, loss: str = "cross-entropy", bpreg: float = 0.0, elu_param: float = 0.0,
                 batch_size: int = 1):
        self.model, self.loss, self.bpreg, self.elu_param = model, loss, bpreg, elu_param
        self.batch_size = batch_size  # gradients are of the summed loss / batch_size

    @torch.no_grad()
    def __call__(self, state: tuple[torch.Tensor, ...], inputs: torch.Tensor, columns: torch.Tensor,
                 log_q: torch.Tensor | None = None) -> tuple[float, tuple[torch.Tensor, ...]]:
        """state: each layer's (B, H_l) hidden state (reset rows already zeroed); inputs (B,) the items fed
        in; columns (M,) the items scored, columns[:B] the targets; log_q (M,) the logQ correction of each
        column, subtracted from its scores. Returns the summed loss and the new state; gradients are left
        in the parameters' `.grad` (of the loss divided by the configured batch size)."""
        m = self.model
        H = m.cfg.layers[-1]
        table = m.out.weight if m.E is None else m.E.weight
        x = table.index_select(0, inputs)
        if m.E is None:
            x = x[:, :H]
        embed_mask = m.drop_embed.mask(x)
        if embed_mask is not None:
            x = x * embed_mask
        saved, new_state = [], []
        for layer, h in zip(m.gru, state, strict=True):
            k = layer.hidden
            gi = x if layer.w_ih is None else torch.addmm(layer.b_ih, x, layer.w_ih.t())
            gh = torch.addmm(layer.b_hh, h, layer.w_hh.t())
            rz = torch.sigmoid(gi[:, :2 * k] + gh[:, :2 * k])
            gh_n = gh[:, 2 * k:]
            n = torch.tanh(torch.addcmul(gi[:, 2 * k:], rz[:, :k], gh_n))
            y = torch.lerp(n, h, rz[:, k:])
            mask = m.drop_hidden.mask(y)
            if mask is not None:
                y = y * mask
            saved.append((x, h, rz, n, gh_n, mask))
            new_state.append(y)
            x = y

        W = m.out.weight.index_select(0, columns)
        O = torch.addmm(W[:, H], x, W[:, :H].t())
        if log_q is not None:
            O.sub_(log_q)
        loss, dO = self._loss_and_grad(O)
        dO.div_(self.batch_size)

        B, M = dO.shape
        out_rows = columns
        out_grad = torch.empty(M, H + 1)
        torch.mm(dO.t(), x, out=out_grad[:, :H])
        torch.sum(dO, 0, out=out_grad[:, H])
        dx = dO @ W[:, :H]
        for layer, (x, h, rz, n, gh_n, mask) in zip(reversed(m.gru), reversed(saved), strict=True):
            k = layer.hidden
            if mask is not None:
                dx = dx * mask
            r, z = rz[:, :k], rz[:, k:]
            dn = dx * (1 - z) * (1 - n * n)
            d_rz = torch.cat([dn * gh_n, dx * (h - n)], 1).mul_(rz * (1 - rz))
            dgi = torch.cat([d_rz, dn], 1)
            dgh = torch.cat([d_rz, dn * r], 1)
            layer.w_hh.grad = dgh.t() @ h
            layer.b_hh.grad = dgh.sum(0)
            if layer.w_ih is None:  # one-hot input: gi is the looked-up row itself
                dx = dgi
            else:
                layer.w_ih.grad = dgi.t() @ x
                layer.b_ih.grad = dgi.sum(0)
                dx = dgi @ layer.w_ih
        if embed_mask is not None:
            dx = dx * embed_mask
        if m.E is None:  # the shared table: input rows get gradient in their embedding part, none in the bias
            out_rows = torch.cat([columns, inputs])
            out_grad = torch.cat([out_grad, F.pad(dx, (0, 1))])
        else:
            m.E.weight.grad = row_gradient(inputs, dx, m.E.weight.shape)
        m.out.weight.grad = row_gradient(out_rows, out_grad, m.out.weight.shape)
        return loss, tuple(new_state)

    def _loss_and_grad(self, O: torch.Tensor) -> tuple[float, torch.Tensor]:
        if self.loss == "cross-entropy":  # sum over rows of logsumexp(O_b) - O_bb; gradient softmax - I
            lse = torch.logsumexp(O, 1, keepdim=True)
            loss = (lse.sum() - O.diagonal().sum()).item()
            dO = O.sub_(lse).exp_()
            dO.diagonal().sub_(1.0)
            return loss, dO
        with torch.enable_grad():
            O.requires_grad_(True)
            value = sampled_loss(O, self.loss, self.bpreg, self.elu_param)
            (dO,) = torch.autograd.grad(value, O)
        return value.item(), dO


def row_gradient(rows: torch.Tensor, values: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Coalesced sparse gradient of a (V, D) table: values (N, D) for rows (N,), repeated rows summed."""
    unique, inverse = torch.unique(rows, return_inverse=True)
    summed = torch.zeros(len(unique), values.shape[1]).index_add_(0, inverse, values)
    return torch.sparse_coo_tensor(unique.unsqueeze(0), summed, shape, is_coalesced=True, check_invariants=False)


def sampled_loss(O: torch.Tensor, kind: str, bpreg: float = 0.0, elu_param: float = 0.0) -> torch.Tensor:
    """O (M, M + n): row b's positive in column b, every other column a negative. Summed over rows."""
    if kind == "cross-entropy":
        return (torch.logsumexp(O, 1) - O.diagonal()).sum()
    positive = O.diagonal().unsqueeze(1)
    negative = torch.ones_like(O, dtype=torch.bool)
    negative.diagonal().fill_(False)
    if kind == "bpr":
        return -(F.logsigmoid(positive - O) * negative).sum() / max(O.shape[1] - 1, 1)
    if kind == "bpr-max":
        if elu_param > 0:
            O = F.elu(O, elu_param)
            positive = O.diagonal().unsqueeze(1)
        log_s = torch.log_softmax(O.masked_fill(~negative, float("-inf")), 1)
        ranking = -torch.logsumexp(log_s + F.logsigmoid(positive - O), 1)
        reg = (log_s.exp() * O.pow(2)).sum(1)
        return (ranking + bpreg * reg).sum()
    raise ValueError(f"unknown loss {kind!r}")
