"""The hand-written gradients of a GRU4Rec training step equal autograd through the model's own forward."""

import copy

import pytest
import torch

from nextstep.models.gru4rec import GRU4Rec, GRU4RecConfig
from nextstep.training.next_item.gru4rec_step import TrainStep, row_gradient, sampled_loss

V = 30
MODES = {"constrained": {}, "embedding": {"constrained_embedding": False, "embedding": 6},
         "one_hot": {"constrained_embedding": False, "embedding": 0}}
LOSSES = {"cross-entropy": {}, "bpr": {}, "bpr-max": {"bpreg": 0.7}, "bpr-max-elu": {"bpreg": 0.5, "elu_param": 0.5}}


def autograd_step(m, state, inputs, columns, log_q, loss, bpreg=0.0, elu_param=0.0):
    """The reference: the model's forward pass (advance, then the whole-catalogue scores restricted to
    the columns) and autograd of the summed loss divided by the batch size."""
    m.zero_grad(set_to_none=True)
    new_state = m.advance(state, inputs)
    O = m.scores(new_state)[:, columns]
    if log_q is not None:
        O = O - log_q
    value = sampled_loss(O, loss, bpreg, elu_param)
    (value / len(inputs)).backward()
    return value.item(), new_state


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("layers", [(8,), (8, 5)])
@pytest.mark.parametrize("dropout", [(0.0, 0.0), (0.3, 0.4)])
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_gradients_loss_and_state_equal_autograd(mode, layers, dropout, loss):
    torch.manual_seed(0)
    m = GRU4Rec(GRU4RecConfig(n_items=V, layers=layers, dropout_embed=dropout[0], dropout_hidden=dropout[1],
                              **MODES[mode])).train()
    with torch.no_grad():  # nonzero biases, so their gradients are exercised through nonlinear paths
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ref = copy.deepcopy(m)
    B = 5
    g = torch.Generator().manual_seed(1)
    state = tuple(torch.randn(B, h, generator=g) for h in layers)
    state[0][1] = 0.0  # a slot that was just reset
    inputs = torch.tensor([2, 7, 7, 11, 3])  # a repeated input row
    targets = torch.tensor([7, 4, 9, 9, 12])  # targets shared by two slots, one equal to another slot's input
    columns = torch.cat([targets, torch.tensor([4, 20, 2, 20, 29])])  # negatives repeat targets and each other
    log_q = torch.log(torch.rand(len(columns), generator=g) * 40 + 1) if loss == "cross-entropy" else None
    kind = loss.removesuffix("-elu")

    torch.manual_seed(5)
    want_loss, want_state = autograd_step(ref, state, inputs, columns, log_q, kind, **LOSSES[loss])
    torch.manual_seed(5)  # the same dropout masks
    got_loss, got_state = TrainStep(m, kind, **LOSSES[loss], batch_size=B)(state, inputs, columns, log_q)

    assert got_loss == pytest.approx(want_loss, rel=1e-5)
    for got, want in zip(got_state, want_state, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    for (name, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        want = q.grad.to_dense() if q.grad.is_sparse else q.grad
        assert p.grad is not None, name
        if p.grad.is_sparse:
            assert p.grad.is_coalesced() and len(p.grad.indices()[0].unique()) == p.grad.indices().shape[1]
        torch.testing.assert_close(p.grad.to_dense(), want, atol=1e-5, rtol=1e-4, msg=name)


def test_row_gradient_sums_repeated_rows():
    values = torch.arange(8.0).view(4, 2)
    grad = row_gradient(torch.tensor([3, 1, 3, 0]), values, torch.Size([5, 2]))
    assert grad.is_coalesced()
    torch.testing.assert_close(grad.to_dense(), torch.tensor([[6.0, 7.0], [2, 3], [0, 0], [4, 6], [0, 0]]))
