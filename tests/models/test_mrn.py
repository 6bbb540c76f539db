"""MRN (seed 004): discretisation, straight-through gradients, exact match, streaming = full pass, causality."""

import pytest
import torch

from nextstep.models.mrn import MRN, MRNConfig
from nextstep.training.next_item.sessions import zipf_sessions

ALL_ON = dict(dim=8, modulus=5, history=4, parallel=2, alpha=2.0, repeat=0.5, use_context=True)
HEADS_ON = dict(ALL_ON, repeat_learned=True, heads={"transition": {"rank": 6, "init": 0.5, "window": 3}})


def sessions(n=6, n_items=40, length=7, seed=0):
    data = zipf_sessions(n, n_items - 2, length_range=(length, length), follow=0.5, seed=seed)
    return torch.from_numpy(data.items.reshape(n, length)).long() + 1  # rows >= 2


def test_discretisation_is_round_then_mod_in_z_m():
    model = MRN(MRNConfig(n_items=30, dim=6, modulus=7))
    with torch.no_grad():
        model.E.uniform_(-20, 20)
        x = model.states()
    assert torch.equal(x, torch.remainder(torch.round(model.E), 7))
    assert torch.equal(x, x.round()) and x.min() >= 0 and x.max() <= 6


def test_ste_gradients_reach_the_embeddings():
    model = MRN(MRNConfig(n_items=40, **ALL_ON)).train()
    items = sessions()
    scores = model(items)
    target = torch.roll(items, -1, 1)
    loss = torch.nn.functional.cross_entropy(scores.flatten(0, 1), target.flatten())
    loss.backward()
    grad = model.E.grad
    assert grad is not None and torch.isfinite(grad).all()
    touched = grad.abs().sum(1) > 0
    assert touched[items.unique()].all()  # every clicked item's embedding learns
    assert touched.sum() > len(items.unique())  # and candidates beyond them, through the match surrogate


def test_forward_value_is_the_hard_model_in_training_too():
    model = MRN(MRNConfig(n_items=40, **ALL_ON))
    items = sessions()
    model.train()
    hard_train = model(items)
    with torch.no_grad():
        hard_eval = model.eval()(items)
    assert torch.equal(hard_train.detach(), hard_eval)


def test_match_is_exact_symmetric_and_bounded():
    model = MRN(MRNConfig(n_items=10, dim=12, modulus=4))
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 4, (50, 12), generator=g).float()
    x = torch.randint(0, 4, (50, 12), generator=g).float()
    m = model.match(q, x)
    assert torch.equal(m, (q == x).sum(1).float())
    assert torch.equal(m, model.match(x, q))
    assert m.min() >= 0 and m.max() <= 12
    assert torch.equal(model.match(q, q), torch.full((50,), 12.0))
    # the surrogate: gradients where coordinates differ by one step, symmetric in q and x
    q.requires_grad_(True)
    x.requires_grad_(True)
    model.match(q, x).sum().backward()
    assert torch.allclose(q.grad, -x.grad)


def randomised(model):
    """Learned parts away from their initial values, so that a wrong index or window shows in the scores."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        if model.gamma is not None:
            model.gamma.copy_(torch.rand(model.gamma.shape, generator=g) * 2 - 0.5)
        if model.bias is not None:
            model.bias.copy_(torch.randn(model.bias.shape, generator=g))
        for head in model.heads.values():
            if getattr(head, "a", None) is not None:
                head.a.copy_(torch.randn(head.a.shape, generator=g))
    return model


@pytest.mark.parametrize("options", [dict(dim=8, modulus=5, history=4, parallel=2), ALL_ON, HEADS_ON])
def test_stepping_equals_forward(options):
    model = randomised(MRN(MRNConfig(n_items=40, **options))).eval()
    items = sessions()
    with torch.no_grad():
        full = model(items)
        state = model.init_state(len(items))
        for t in range(items.shape[1]):
            state = model.step(state, items[:, t])
            assert (model.scores(state) - full[:, t]).abs().max() <= 1e-5
    assert state[2].tolist() == [items.shape[1]] * len(items)
    assert state[0].shape == (len(items), 4, 8) and state[1].shape == (len(items), 8)


@pytest.mark.parametrize("options", [ALL_ON, HEADS_ON])
def test_no_future_leak(options):
    model = randomised(MRN(MRNConfig(n_items=40, **options))).eval()
    items = sessions()
    with torch.no_grad():
        base = model(items)
        for t in range(items.shape[1] - 1):
            changed = items.clone()
            changed[:, t + 1:] = torch.randint(2, 40, changed[:, t + 1:].shape)
            assert torch.equal(model(changed)[:, :t + 1], base[:, :t + 1])


def test_repeat_channel_marks_window_items():
    model = MRN(MRNConfig(n_items=40, dim=16, modulus=8, history=3, parallel=1, repeat=1.0, use_bias=False)).eval()
    items = torch.tensor([[5, 9, 11, 13]])
    with torch.no_grad():
        state = model.init_state(1)
        for t in range(4):
            state = model.step(state, items[:, t])
        with_repeat = model.scores(state)
        model.cfg.repeat = 0.0
        without = model.scores(state)
    bump = (with_repeat - without)[0] * model.cfg.temperature
    assert bump[[9, 11, 13]].tolist() == [1.0, 1.0, 1.0]  # the last L = 3 clicks
    states = model.states()
    if not any(torch.equal(states[5], states[j]) for j in (9, 11, 13)):  # no exact state collision
        assert bump[5] == 0.0  # clicked before the window


def test_heads_learn_and_change_the_scores():
    model = MRN(MRNConfig(n_items=40, **HEADS_ON)).train()
    items = sessions()
    scores = model(items)
    loss = torch.nn.functional.cross_entropy(scores[:, :-1].flatten(0, 1), items[:, 1:].flatten())
    loss.backward()
    head = model.heads["transition"]
    for p in (head.U, head.W, head.a, model.gamma):
        assert p.grad is not None and p.grad.abs().sum() > 0
    with torch.no_grad():  # the head's term is its own: without it the scores differ, and by exactly its value
        state = model.init_state(len(items))
        for t in range(3):
            state = model.step(state, items[:, t])
        with_head = model.scores(state)
        term = head(model.code, *state, model.code(model.states()))
        heads, model.heads = model.heads, torch.nn.ModuleDict()
        without = model.scores(state)
        model.heads = heads
    assert term.abs().max() > 0 and torch.allclose(with_head - without, term, atol=1e-5)
    with torch.no_grad():  # before any event the head adds nothing
        first = model.scores(model.init_state(2))
    assert torch.equal(first, model.bias.expand(2, -1))


def test_learned_repeat_weights_each_window_position():
    model = MRN(MRNConfig(n_items=40, dim=16, modulus=8, history=3, parallel=1, repeat=1.0, repeat_learned=True,
                          use_bias=False)).eval()
    with torch.no_grad():
        model.gamma.copy_(torch.tensor([0.5, 2.0, 3.0]))
        states = model.states()
    items = torch.tensor([[5, 9, 11, 9]])  # window after the last click: 9 (l=0), 11 (l=1), 9 (l=2)
    assert len({tuple(states[j].tolist()) for j in (5, 9, 11)}) == 3  # no state collision among the three
    with torch.no_grad():
        state = model.init_state(1)
        for t in range(4):
            state = model.step(state, items[:, t])
        bump = model.scores(state)
        model.cfg.repeat, model.gamma = 0.0, None
        bump = (bump - model.scores(state))[0] * model.cfg.temperature
    assert torch.allclose(bump[[9, 11, 5]], torch.tensor([0.5 + 3.0, 2.0, 0.0]))  # 5 left the window


def test_config_validation():
    with pytest.raises(ValueError):
        MRNConfig(n_items=10, heads={"nonsense": {}})
    with pytest.raises(ValueError):
        MRNConfig(n_items=10, history=2, parallel=3)
    with pytest.raises(ValueError):
        MRNConfig(n_items=2)
