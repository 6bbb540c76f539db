"""DKT as a streaming model: the full pass equals stepping, nothing leaks from the future or across the batch,
a question's answer does not depend on the other questions asked with it, and the output is the paper's."""

import pytest
import torch

from nextstep.models.dkt import DKT, DKTConfig

Q = 15


def make(K: int = 2, seed: int = 0, **overrides) -> DKT:
    torch.manual_seed(seed)
    return DKT(DKTConfig(**{"n_questions": Q, "n_cats": K, "hidden": 12, "embed_dim": 10, **overrides})).eval()


def sequences(B: int, T: int, K: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, Q, (B, T), generator=g), torch.randint(0, K, (B, T), generator=g)


@pytest.mark.parametrize("K,layers", [(2, 1), (4, 2)])
def test_forward_equals_stepping(K, layers):
    model = make(K, layers=layers)
    q, r = sequences(3, 20, K)
    with torch.no_grad():
        full = model(q, r).log_probs
        state = model.init_state(3)
        for t in range(q.shape[1]):
            out = model.readout(state, q[:, t:t + 1]).log_probs[:, 0]
            assert (out - full[:, t]).abs().max().item() <= 1e-5, t
            state = model.step(state, q[:, t], r[:, t])
    assert full.shape == (3, 20, K)
    torch.testing.assert_close(full.exp().sum(-1), torch.ones(3, 20))


def test_no_future_leak_and_history_matters():
    model = make(3)
    q, r = sequences(2, 12, 3)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        base = model(q, r).log_probs
        for t in range(1, 11):
            q2, r2 = q.clone(), r.clone()
            q2[:, t + 1:] = torch.randint(2, Q, (2, 12 - t - 1), generator=g)
            r2[:, t:] = (r[:, t:] + 1) % 3  # the response at t and everything after
            out = model(q2, r2).log_probs
            assert torch.equal(out[:, :t + 1], base[:, :t + 1]), t  # the prediction at t sees q_t, not r_t
            assert (out[:, t + 1] - base[:, t + 1]).abs().max() > 1e-6  # but r_t moves the one after it
        # students in a batch are independent
        q3, r3 = q.clone(), r.clone()
        q3[1], r3[1] = torch.randint(2, Q, (12,), generator=g), torch.randint(0, 3, (12,), generator=g)
        assert torch.equal(model(q3, r3).log_probs[0], base[0])


def test_readout_answers_each_question_as_if_asked_alone():
    model = make(4)
    q, r = sequences(2, 6, 4)
    candidates = torch.tensor([[2, 5, 9, 14], [3, 3, 7, 11]])
    with torch.no_grad():
        state = model.init_state(2)
        for t in range(6):
            state = model.step(state, q[:, t], r[:, t])
        together = model.readout(state, candidates).log_probs
        for m in range(4):
            torch.testing.assert_close(together[:, m], model.readout(state, candidates[:, m:m + 1]).log_probs[:, 0])
    assert (together[0, 0] - together[0, 1]).abs().max() > 1e-4  # the question matters


def test_binary_output_is_the_papers_sigmoid():
    model = make(2)
    q, r = sequences(2, 5, 2)
    with torch.no_grad():
        state = model.init_state(2)
        for t in range(5):
            state = model.step(state, q[:, t], r[:, t])
        p_right = model.readout(state, q[:, :1]).log_probs[:, 0, 1].exp()
        h = state[0][:, -1]
        logit = (model.out_w(q[:, 0]) * h).sum(-1) + model.out_b(q[:, 0])[:, 0]
    torch.testing.assert_close(p_right, torch.sigmoid(logit))


def test_every_parameter_learns():
    model = make(2, dropout=0.0).train()
    q, r = sequences(4, 9, 2)
    out = model(q, r).log_probs
    torch.nn.functional.nll_loss(out.reshape(-1, 2), r.reshape(-1)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="n_cats"):
        DKTConfig(n_questions=10, n_cats=1)
    with pytest.raises(ValueError, match="dropout"):
        DKTConfig(n_questions=10, dropout=1.0)
