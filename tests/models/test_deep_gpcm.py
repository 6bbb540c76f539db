"""The Deep-GPCM family as streaming models: the full-sequence pass equals stepping, nothing leaks from the
future or across the batch, the outputs are valid GPCM quantities, and every parameter learns."""

import pytest
import torch
import torch.nn.functional as F

from nextstep.models.deep_gpcm import MODELS, GPCMConfig

TINY = {"n_questions": 20, "memory_size": 8, "key_dim": 8, "value_dim": 16, "summary_dim": 8,
        "embed_dim": 16, "n_heads": 2, "window": 5}
K = 4
FIELDS = ("log_probs", "theta", "alpha", "beta")

# every class, and the settings that add a part: the Bayes ability with fading evidence (a learned keep share),
# a recurrent learner state beside the memory
CASES = {**{name: (cls, {}) for name, cls in MODELS.items()},
         "deep_gpcm_bayes_drift": (MODELS["deep_gpcm_bayes"], {"evidence_keep": 0.9}),
         # the form the export takes (for_serving: the item side looked up in tables), held to the same promises
         # against the model's own forward pass
         "deep_gpcm_bayes_served": (lambda cfg: MODELS["deep_gpcm_bayes"](cfg).for_serving(), {}),
         "deep_gpcm_bayes_drift_served": (lambda cfg: MODELS["deep_gpcm_bayes"](cfg).for_serving(),
                                          {"evidence_keep": 0.9}),
         # with the rest of right/wrong data's defaults: the item's own discrimination, the order penalty
         "deep_gpcm_learner": (MODELS["deep_gpcm"], {"learner_dim": 6, "item_discrimination": True,
                                                     "order_penalty": 1.0}),
         "attention_gpcm_learner": (MODELS["attention_gpcm"], {"learner_dim": 6})}
pytestmark = pytest.mark.parametrize("name", sorted(CASES))


def make(name: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    cls, settings = CASES[name]
    return cls(GPCMConfig(**{**TINY, **settings, **overrides})).eval()


def sequences(B: int, T: int, seed: int = 1, n_questions: int = TINY["n_questions"]):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(2, n_questions, (B, T), generator=g)
    r = torch.randint(0, K, (B, T), generator=g)
    return q, r


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("B,T", [(1, 3), (3, 17)])  # T=17 > window=5: the attention window wraps
def test_forward_equals_stepping(name, B, T):
    model = make(name)
    q, r = sequences(B, T)
    with torch.no_grad():
        full = model(q, r)
        state = model.init_state(B)
        for t in range(T):
            out = model.readout(state, q[:, t:t + 1])  # (B, 1, ...)
            for f in FIELDS:
                assert max_diff(getattr(out, f)[:, 0], getattr(full, f)[:, t]) <= 1e-5, (f, t)
            if full.cum_logits is not None:
                assert max_diff(out.cum_logits[:, 0], full.cum_logits[:, t]) <= 1e-5, ("cum_logits", t)
            state = model.step(state, q[:, t], r[:, t])
    assert full.log_probs.shape == (B, T, K) and full.beta.shape == (B, T, K - 1)
    assert full.theta.shape == full.alpha.shape == (B, T)


def test_predict_several_questions_at_once(name):
    """predict(state, (B, M)) answers each of the M questions as if asked alone."""
    model = make(name)
    q, r = sequences(2, 7)
    candidates = torch.tensor([[2, 5, 9, 19], [3, 3, 7, 11]])
    with torch.no_grad():
        state = model.init_state(2)
        for t in range(7):
            state = model.step(state, q[:, t], r[:, t])
        together = model.readout(state, candidates)
        for m in range(candidates.shape[1]):
            alone = model.readout(state, candidates[:, m:m + 1])
            for f in FIELDS:
                assert max_diff(getattr(together, f)[:, m], getattr(alone, f)[:, 0]) <= 1e-6, (f, m)
    # different questions get different answers: the question matters
    assert max_diff(together.log_probs[0, 0], together.log_probs[0, 1]) > 1e-4


def test_no_future_leak_and_history_matters(name):
    model = make(name)
    B, T = 2, 12
    q, r = sequences(B, T)
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        base = model(q, r)
        for t in range(1, T):
            q2, r2 = q.clone(), r.clone()
            q2[:, t:] = torch.randint(2, TINY["n_questions"], (B, T - t), generator=g)
            r2[:, t:] = (r[:, t:] + torch.randint(1, K, (B, T - t), generator=g)) % K  # every one differs
            changed = model(q2, r2)
            for f in FIELDS:
                assert max_diff(getattr(changed, f)[:, :t], getattr(base, f)[:, :t]) <= 1e-6, (f, t)

            r3 = r.clone()
            r3[:, t - 1] = (r[:, t - 1] + 2) % K
            past = model(q, r3)
            # the earlier positions are untouched, the output at t sees the changed response
            assert max_diff(past.log_probs[:, :t], base.log_probs[:, :t]) <= 1e-6
            moved = (past.log_probs[:, t] - base.log_probs[:, t]).abs().amax(-1)  # (B,)
            assert (moved > 1e-5).all(), (t, moved)
            assert (past.theta[:, t] != base.theta[:, t]).all(), t


def test_batch_rows_are_independent(name):
    model = make(name)
    B, T = 4, 9
    q, r = sequences(B, T)
    q2, r2 = q.clone(), r.clone()
    q2[2] = torch.flip(q[2], [0])
    r2[2] = (r[2] + 1) % K
    with torch.no_grad():
        base, changed = model(q, r), model(q2, r2)
        others = [0, 1, 3]
        for f in FIELDS:
            assert max_diff(getattr(changed, f)[others], getattr(base, f)[others]) <= 1e-6, f
        assert max_diff(changed.log_probs[2], base.log_probs[2]) > 1e-4  # the changed row did change
        for i in range(B):  # and each row is what the model gives for that sequence alone
            alone = model(q[i:i + 1], r[i:i + 1])
            for f in FIELDS:
                assert max_diff(getattr(alone, f)[0], getattr(base, f)[i]) <= 1e-5, (f, i)


def test_outputs_are_valid_gpcm_quantities(name):
    model = make(name)
    q, r = sequences(3, 10)
    with torch.no_grad():
        out = model(q, r)
    probs = out.log_probs.exp()
    assert torch.isfinite(out.log_probs).all()
    assert (probs > 0).all()
    assert max_diff(probs.sum(-1), torch.ones(3, 10)) <= 1e-5
    assert (out.alpha > 0).all()
    assert (out.beta.diff(dim=-1) > 0).all()  # ordered thresholds, strictly
    if name == "coral_gpcm":
        # P(Y > k) = sigmoid(alpha (theta - tau_k)) with tau increasing: the cumulative logits decrease
        assert out.cum_logits.shape == (3, 10, K - 1)
        assert (out.cum_logits.diff(dim=-1) < 0).all()
    else:
        assert out.cum_logits is None


def test_unordered_thresholds_are_the_raw_projection(name):
    model = make(name, ordered_thresholds=False)
    q, r = sequences(3, 10)
    with torch.no_grad():
        out = model(q, r)
        raw = model.head.thresholds.linear(model.question_embed(q))
    assert out.beta.shape == (3, 10, K - 1)
    assert max_diff(out.beta, raw) == 0.0  # no reordering: beta is whatever the item projection gives
    assert max_diff(out.log_probs.exp().sum(-1), torch.ones(3, 10)) <= 1e-5
    assert (out.alpha > 0).all()


def test_predict_and_step_leave_the_given_state_alone(name):
    model = make(name)
    q, r = sequences(2, 8)
    with torch.no_grad():
        state = model.init_state(2)
        for t in range(6):
            state = model.step(state, q[:, t], r[:, t])
        before = [s.clone() for s in state]
        first = model.readout(state, q[:, 6:8])
        for a, b in zip(state, before, strict=True):
            assert torch.equal(a, b)
        second = model.readout(state, q[:, 6:8])
        for f in FIELDS:
            assert torch.equal(getattr(first, f), getattr(second, f))
        nxt = model.step(state, q[:, 6], r[:, 6])  # step returns a new state, the old one is kept
        for a, b in zip(state, before, strict=True):
            assert torch.equal(a, b)
        assert max_diff(nxt[0], state[0]) > 0
        # a fresh initial state is not aliased to the learned parameter
        fresh = model.init_state(1)
        fresh[0].add_(1.0)
        assert max_diff(model.init_state(1)[0], fresh[0]) == pytest.approx(1.0)


def test_every_parameter_gets_a_gradient(name):
    if name.endswith("_served"):
        pytest.skip("a served form trains no further: its forward and parameters are the model's, tested as such")
    model = make(name)
    model.train()
    q, r = sequences(4, 8, seed=5)
    q[0, :3] = 0  # some padding rows too
    out = model(q, r)
    loss = F.nll_loss(out.log_probs.reshape(-1, K), r.reshape(-1))
    if out.cum_logits is not None:
        above = (r.unsqueeze(-1) > torch.arange(K - 1)).float()
        loss = loss + F.binary_cross_entropy_with_logits(out.cum_logits, above)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, pname
    # embedding rows: the padding row never learns, every question in the batch does
    grad = model.question_embed.weight.grad
    assert grad[0].abs().sum() == 0
    used = torch.unique(q[q > 0])
    assert (grad[used].abs().sum(-1) > 0).all()
    unused = sorted(set(range(TINY["n_questions"])) - set(used.tolist()) - {0})
    assert all(grad[i].abs().sum() == 0 for i in unused)
