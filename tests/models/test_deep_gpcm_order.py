"""Deep-GPCM's order penalty: the counterfactual read-outs it trains on are exactly what stepping the model with each
answer gives, it only exists in training, it leaves the predictions alone, and its gradient orders the answers."""

import pytest
import torch

from nextstep.models.deep_gpcm import MODELS, GPCMConfig, deep_gpcm

TINY = {"n_questions": 20, "memory_size": 8, "key_dim": 8, "value_dim": 16, "summary_dim": 8}
CASES = {"binary, learner state": ("deep_gpcm", 2, {"learner_dim": 6}),
         "binary, memory alone": ("deep_gpcm", 2, {"learner_dim": 0}),
         "ordinal, memory ability": ("deep_gpcm", 4, {"learner_dim": 0}),
         "coral, learner state": ("coral_gpcm", 4, {"learner_dim": 6})}


def make(case: str, penalty: float = 1.0, seed: int = 0, **overrides):
    name, n_cats, settings = CASES[case]
    torch.manual_seed(seed)
    cfg = GPCMConfig(**{**TINY, "n_cats": n_cats, "ability": "memory", "order_penalty": penalty, "dropout": 0.3,
                        **settings, **overrides})
    return MODELS[name](cfg)


def sequences(B: int, T: int, n_cats: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, TINY["n_questions"], (B, T), generator=g), torch.randint(0, n_cats, (B, T), generator=g)


@torch.no_grad()
def stepped_counterfactuals(model, q, r):
    """Theta after each answer at each step, on the question answered and on the next, by stepping (as served)."""
    model.eval()
    B, T = q.shape
    K = model.cfg.n_cats
    same, following = torch.zeros(B, T, K), torch.zeros(B, T, K)
    state = model.init_state(B)
    for t in range(T):
        for k in range(K):
            after = model.step(state, q[:, t], torch.full((B,), k))
            same[:, t, k] = model.readout(after, q[:, t:t + 1]).theta[:, 0]
            if t + 1 < T:
                following[:, t, k] = model.readout(after, q[:, t + 1:t + 2]).theta[:, 0]
        state = model.step(state, q[:, t], r[:, t])
    return same, following


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_penalty_is_the_disorder_of_what_stepping_gives(case):
    model = make(case, penalty=0.7)
    q, r = sequences(3, 9, model.cfg.n_cats)
    same, following = stepped_counterfactuals(model, q, r)
    model.train()
    penalty = model(q, r).order_penalty  # dropout is on: the penalty's theta is the served one regardless
    falls = lambda theta: torch.relu(theta[..., :-1] - theta[..., 1:]).sum(-1)  # noqa: E731
    expected = falls(same)
    expected[:, 1:] += falls(following[:, :-1])  # the next question's fall belongs to the step that asks it
    assert penalty.shape == (3, 9)
    assert torch.allclose(penalty, 0.7 * expected, atol=1e-5)
    assert expected.sum() > 0  # an untrained model is not ordered: the check compares something


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_penalty_changes_no_prediction_and_exists_only_in_training(case):
    with_penalty, without = make(case, penalty=1.0, dropout=0.0), make(case, penalty=0.0, dropout=0.0)
    without.load_state_dict(with_penalty.state_dict())
    q, r = sequences(2, 7, with_penalty.cfg.n_cats)
    with_penalty.train(), without.train()
    a, b = with_penalty(q, r), without(q, r)
    for field in ("log_probs", "theta", "alpha", "beta"):  # equal up to the summation order of the wider read
        assert torch.allclose(getattr(a, field), getattr(b, field), atol=1e-6), field
    assert b.order_penalty is None
    assert with_penalty.eval()(q, r).order_penalty is None


def test_training_on_the_penalty_orders_the_answers():
    model = make("binary, learner state", penalty=1.0, dropout=0.0)
    q, r = sequences(8, 12, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    start = model(q, r).order_penalty.mean().item()
    for _ in range(60):
        opt.zero_grad()
        model(q, r).order_penalty.mean().backward()
        opt.step()
    end = model(q, r).order_penalty.mean().item()
    assert start > 1e-3 and end < start / 20, (start, end)


@pytest.mark.parametrize("name,settings,message", [
    ("deep_gpcm", {"n_cats": 4}, "ordered already"),  # the Bayes ability, ordinal data's default
    ("attention_gpcm", {"n_cats": 2}, "not attention_gpcm"),
])
def test_the_penalty_is_refused_where_it_does_not_apply(name, settings, message):
    with pytest.raises(ValueError, match=message):
        if name == "deep_gpcm":
            deep_gpcm(GPCMConfig(**TINY, **settings, order_penalty=1.0))
        else:
            MODELS[name](GPCMConfig(**TINY, **settings, order_penalty=1.0, embed_dim=16, n_heads=2, window=5))


def test_a_negative_weight_is_refused():
    with pytest.raises(ValueError, match="order_penalty"):
        GPCMConfig(**TINY, order_penalty=-1.0)


def test_right_wrong_data_gets_the_penalty_and_the_items_discrimination_by_default():
    binary = deep_gpcm(GPCMConfig(n_questions=20, n_cats=2))
    assert (binary.cfg.ability, binary.cfg.order_penalty, binary.cfg.item_discrimination) == ("memory", 1.0, True)
    ordinal = deep_gpcm(GPCMConfig(n_questions=20, n_cats=4))
    assert (ordinal.cfg.ability, ordinal.cfg.order_penalty, ordinal.cfg.item_discrimination) == ("bayes", 0.0, False)
    asked = deep_gpcm(GPCMConfig(n_questions=20, n_cats=2, order_penalty=0.0, item_discrimination=False))
    assert (asked.cfg.order_penalty, asked.cfg.item_discrimination) == (0.0, False)
    variant = MODELS["coral_gpcm"](GPCMConfig(n_questions=20, n_cats=2))
    assert (variant.cfg.order_penalty, variant.cfg.item_discrimination) == (0.0, False)


def test_an_artifact_from_before_the_penalty_restores_without_it():
    from dataclasses import asdict

    from nextstep.models.deep_gpcm import restore
    old = deep_gpcm(GPCMConfig(n_questions=20, n_cats=2, order_penalty=0.0, item_discrimination=False))
    config = {k: v for k, v in asdict(old.cfg).items() if k != "order_penalty"}
    restored = restore("deep_gpcm", config, old.state_dict())
    assert restored.cfg.order_penalty == 0.0 and restored.cfg.item_discrimination is False
