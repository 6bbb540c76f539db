"""deep_gpcm's Bayes ability filter (BayesGPCM), its data-dependent defaults and the IRT warm start.

Streaming parity, no-leak, batch independence and gradients of BayesGPCM are in test_deep_gpcm.py (its MODELS
entry "deep_gpcm_bayes"); export parity in tests/training/test_export.py. Here: that one slot is the exact
Bayes filter, which family builds what, and that the warm start puts the fitted items into the model."""

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from nextstep.models.deep_gpcm import CORALGPCM, AttentionGPCM, BayesGPCM, DeepGPCM, GPCMConfig, deep_gpcm
from nextstep.models.layers.bayes import FLOOR
from nextstep.models.layers.irt import fit_gpcm
from nextstep.models.layers.ordinal import solve_item_embeddings
from nextstep.training.kt.synthetic import generate_gpcm, gpcm_probs

K = 4
FIELDS = ("log_probs", "theta", "alpha", "beta")


def exact_filter(grid, alpha, beta, questions, responses):
    """Posterior predictive and posterior mean of theta in float64, with no floor: (T, K), (T,)."""
    log_post = -0.5 * grid**2
    probs, means = [], []
    for q, r in zip(questions, responses, strict=True):
        p = gpcm_probs(grid, np.full_like(grid, alpha[q]), np.repeat(beta[q][None], len(grid), 0))  # (G, K)
        w = np.exp(log_post - log_post.max())
        w /= w.sum()
        probs.append(w @ p)
        means.append(w @ grid)
        log_post = log_post + np.log(p[:, r])
    return np.array(probs), np.array(means)


def test_one_slot_is_the_exact_bayes_filter():
    torch.manual_seed(0)
    Q, T = 12, 300
    model = BayesGPCM(GPCMConfig(n_questions=Q, n_cats=K, memory_size=1, key_dim=8)).eval()
    rng = np.random.default_rng(0)
    alpha = rng.uniform(1.5, 3.0, Q)  # sharp items: the extreme grid points fall to the floor
    beta = np.sort(rng.normal(0, 1, (Q, K - 1)), 1)
    rows = torch.arange(1, Q)
    solve_item_embeddings(model.question_embed, rows, model.head.thresholds, torch.tensor(beta[1:]),
                          model.head.discrimination, torch.tensor(alpha[1:]))
    with torch.no_grad():  # the model's own item parameters (float32) are what the reference uses
        a, b = model.head(model.question_embed.weight)
    q = torch.from_numpy(rng.integers(2, Q, (2, T)))
    r = torch.from_numpy(rng.integers(0, K, (2, T)))
    with torch.no_grad():
        out = model(q, r)
        state = model.init_state(2)
        for t in range(T):
            state = model.step(state, q[:, t], r[:, t])
    grid = model.grid.grid.double().numpy()
    for i in range(2):
        probs, means = exact_filter(grid, a.double().numpy(), b.double().numpy(), q[i].numpy(), r[i].numpy())
        np.testing.assert_allclose(out.log_probs[i].exp().numpy(), probs, atol=2e-5, rtol=0)
        np.testing.assert_allclose(out.theta[i].numpy(), means, atol=2e-5, rtol=0)
    assert torch.allclose(out.alpha, a[q]) and torch.allclose(out.beta, b[q])
    # the stored evidence is relative to each slot's best point and floored, and the floor was reached
    assert state[0].max(-1).values.abs().max() == 0
    assert state[0].min() == -FLOOR


def test_several_slots_weight_the_evidence_by_the_addressing():
    torch.manual_seed(0)
    model = BayesGPCM(GPCMConfig(n_questions=10, n_cats=K, memory_size=3, key_dim=8)).eval()
    q, r = torch.tensor([[4]]), torch.tensor([[2]])
    with torch.no_grad():
        state = model.step(model.init_state(1), q[:, 0], r[:, 0])
        w = model._address(model.question_embed(q[:, 0]))  # (1, 3)
        _, _, item_lp = model._items(model.question_embed(q[:, 0]))
        ll = item_lp[0, :, 2]
        expected = w[0, :, None] * ll
        expected = (expected - expected.max(-1, keepdim=True).values).clamp(min=-FLOOR)
    torch.testing.assert_close(state[0][0], expected)
    assert torch.allclose(w.sum(-1), torch.ones(1)) and (w > 0).all() and not torch.allclose(w, w[:, :1])


@pytest.mark.parametrize("n_cats, cls, memory_size, irt_init, learner_dim",
                         [(4, BayesGPCM, 1, True, 0), (2, DeepGPCM, 20, False, 50)])
def test_deep_gpcm_defaults_follow_the_data(n_cats, cls, memory_size, irt_init, learner_dim):
    model = deep_gpcm(GPCMConfig(n_questions=10, n_cats=n_cats))
    assert type(model) is cls and model.family == "deep_gpcm"
    assert model.cfg.ability == ("bayes" if n_cats > 2 else "memory")
    assert (model.cfg.memory_size, model.cfg.irt_init, model.cfg.learner_dim) == (memory_size, irt_init, learner_dim)
    assert model.cfg.erase_bias == (-6.0 if n_cats > 2 else -3.0)
    assert [s["name"] for s in model.state_spec()][-1] == ("learner_state" if learner_dim else "value_memory")


def test_settings_given_win_over_the_data_defaults():
    model = deep_gpcm(GPCMConfig(n_questions=10, n_cats=4, ability="memory", memory_size=5))
    assert type(model) is DeepGPCM and model.cfg.memory_size == 5 and model.cfg.irt_init is False
    model = deep_gpcm(GPCMConfig(n_questions=10, n_cats=2, ability="bayes", irt_init=False))
    assert type(model) is BayesGPCM and model.cfg.irt_init is False and model.cfg.memory_size == 20
    for cls in (AttentionGPCM, CORALGPCM):  # the Bayes ability is deep_gpcm's alone
        assert cls(GPCMConfig(n_questions=10, n_cats=4)).cfg.ability == "memory"
        with pytest.raises(ValueError, match="ability 'bayes'"):
            cls(GPCMConfig(n_questions=10, n_cats=4, ability="bayes"))
    with pytest.raises(ValueError, match="ability must be"):
        GPCMConfig(n_questions=10, ability="filter")
    # the learner state: off when asked, on for ordinal data when asked, never with the Bayes filter
    assert deep_gpcm(GPCMConfig(n_questions=10, n_cats=2, learner_dim=0)).cfg.learner_dim == 0
    assert deep_gpcm(GPCMConfig(n_questions=10, n_cats=4, ability="memory", learner_dim=8)).cfg.learner_dim == 8
    for cls in (AttentionGPCM, CORALGPCM, DeepGPCM):  # the default is the family builder's, as the ability is
        assert cls(GPCMConfig(n_questions=10, n_cats=2)).cfg.learner_dim == 0
    with pytest.raises(ValueError, match="learner_dim applies to the memory ability only"):
        deep_gpcm(GPCMConfig(n_questions=10, n_cats=2, ability="bayes", learner_dim=8))
    with pytest.raises(ValueError, match="learner_dim must be"):
        GPCMConfig(n_questions=10, learner_dim=-1)


def small_data(seed: int = 0):
    data = generate_gpcm(n_students=120, n_questions=15, n_cats=K, seq_len_range=(40, 60), seed=seed)
    # vocabulary indices as a run encodes them: question id q -> q + 2 (0 padding, 1 unknown)
    return data, [(s.questions + 2, s.responses) for s in data["train"]]


@pytest.mark.parametrize("ability", ["bayes", "memory"])
def test_warm_start_puts_the_fitted_items_into_the_model(ability):
    data, seqs = small_data()
    Q = data["n_questions"] + 2
    torch.manual_seed(0)
    cfg = GPCMConfig(n_questions=Q, n_cats=K, ability=ability, irt_init=True, item_discrimination=True, key_dim=8)
    model = deep_gpcm(cfg)
    info = model.warm_start(seqs)["irt_init"]
    alpha, beta = fit_gpcm([q for q, _ in seqs], [r for _, r in seqs], Q, K)
    with torch.no_grad():
        keys = model.question_embed(torch.arange(2, Q))
        got_beta = model.head.thresholds(keys).numpy()
        got_alpha = torch.nn.functional.softplus(model.head.discrimination(keys)).squeeze(-1).numpy()
    np.testing.assert_allclose(got_beta, beta[2:], atol=1e-4)
    np.testing.assert_allclose(got_alpha, alpha[2:], atol=1e-4)
    assert info["alpha"] is True and info["items"] == Q - 1 and info["max_error"] < 1e-4
    # and the fit found the generating items (this is what makes the warm start worth having)
    assert spearmanr(got_beta.mean(1), data["beta"].mean(1))[0] > 0.9


def test_the_warm_start_solve_gives_the_same_bits_wherever_its_buffers_land():
    """The same items solved again give the same embeddings to the last bit, whatever was allocated before:
    the demo artifacts must come out the same on every build. (torch's float32 lstsq, MKL's, did not: its
    rounding followed where its workspace landed in memory, and the same data gave solutions ~1e-5 apart, in
    about one call in five here, from run to run and call to call.)"""
    rng = np.random.default_rng(0)
    Q, dk = 40, 8
    beta = torch.from_numpy(np.sort(rng.normal(0, 1, (Q, K - 1)), 1))
    alpha = torch.from_numpy(rng.uniform(0.5, 2.0, Q))
    torch.manual_seed(0)
    model = deep_gpcm(GPCMConfig(n_questions=Q + 1, n_cats=K, item_discrimination=True, key_dim=dk))
    thresholds, discrimination, rows = model.head.thresholds, model.head.discrimination, torch.arange(1, Q + 1)
    solutions, errors, heap = set(), set(), []
    for i in range(60):
        heap.append(torch.empty(i % 13 + 1))  # moves where the next allocations land
        embedding = torch.nn.Embedding(Q + 1, dk)
        errors.add(solve_item_embeddings(embedding, rows, thresholds, beta, discrimination, alpha))
        solutions.add(embedding.weight[1:].detach().numpy().tobytes())
    assert len(solutions) == 1 and len(errors) == 1
    assert errors.pop() < 1e-5


def test_without_irt_init_the_warm_start_does_nothing():
    _, seqs = small_data()
    torch.manual_seed(0)
    model = deep_gpcm(GPCMConfig(n_questions=17, n_cats=K, irt_init=False))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert model.warm_start(seqs) is None
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_an_artifact_from_before_the_bayes_ability_restores_as_the_memory_read_out():
    from dataclasses import asdict

    from nextstep.training.families import restore

    torch.manual_seed(0)
    old = DeepGPCM(GPCMConfig(n_questions=10, n_cats=K, memory_size=4, erase_bias=-6.0, key_dim=8))
    config = {k: v for k, v in asdict(old.cfg).items()
              if k not in ("ability", "grid_size", "grid_limit", "irt_init", "learner_dim")}
    loaded = restore("deep_gpcm", config, old.state_dict())
    assert type(loaded) is DeepGPCM and loaded.cfg.ability == "memory" and loaded.cfg.learner_dim == 0
    q, r = torch.tensor([[2, 5, 7]]), torch.tensor([[1, 3, 0]])
    with torch.no_grad():
        assert torch.equal(old.eval()(q, r).log_probs, loaded.eval()(q, r).log_probs)
    new = deep_gpcm(GPCMConfig(n_questions=10, n_cats=K, key_dim=8))  # a new artifact says what it is
    assert type(restore("deep_gpcm", asdict(new.cfg), new.state_dict())) is BayesGPCM
    # a binary artifact from before the learner state (no "learner_dim") restores without one, as it was trained
    old = deep_gpcm(GPCMConfig(n_questions=10, n_cats=2, key_dim=8, learner_dim=0))
    config = {k: v for k, v in asdict(old.cfg).items() if k != "learner_dim"}
    assert restore("deep_gpcm", config, old.state_dict()).cfg.learner_dim == 0
    new = deep_gpcm(GPCMConfig(n_questions=10, n_cats=2, key_dim=8))
    assert restore("deep_gpcm", asdict(new.cfg), new.state_dict()).cfg.learner_dim == 50


def test_fading_evidence_scales_a_written_slot_s_old_evidence_by_the_keep_share():
    torch.manual_seed(0)
    model = BayesGPCM(GPCMConfig(n_questions=10, n_cats=K, memory_size=1, key_dim=8, evidence_keep=0.8)).eval()
    q, r = torch.tensor([3, 6]), torch.tensor([3, 0])
    with torch.no_grad():
        assert torch.sigmoid(model.keep_logit).item() == pytest.approx(0.8)
        lls = [model._items(model.question_embed(q[t:t + 1]))[2][0, :, r[t]] for t in range(2)]
        state = model.init_state(1)
        for t in range(2):
            state = model.step(state, q[t:t + 1], r[t:t + 1])
    first = lls[0] - lls[0].max()
    expected = 0.8 * first + lls[1]
    torch.testing.assert_close(state[0][0, 0], (expected - expected.max()).clamp(min=-FLOOR))


@pytest.mark.parametrize("n_cats,memory_size,keep", [(4, 1, None), (2, 5, None), (4, 5, 0.9)])
def test_the_served_form_steps_and_reads_out_as_the_model_does_on_every_row(n_cats, memory_size, keep):
    """BayesGPCM.for_serving's tables against the model's computed item side: the state and every output, stepping
    through questions that include the padding row 0 and the unknown row 1, several questions asked at once."""
    from nextstep.models import deep_gpcm as family

    torch.manual_seed(0)
    Q = 12
    model = BayesGPCM(GPCMConfig(n_questions=Q, n_cats=n_cats, memory_size=memory_size, key_dim=8,
                                 evidence_keep=keep)).eval()
    with torch.no_grad():  # larger embeddings: sharper items, evidence reaching the floor
        model.question_embed.weight.mul_(3.0)
    served = model.for_serving()
    assert isinstance(served, family.TabulatedBayesGPCM)
    assert served.state_dict().keys() == model.state_dict().keys()  # weights.pt stays the model's
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, Q, (3, 40), generator=g)
    q[:, :4] = torch.tensor([0, 1, 1, 0])
    r = torch.randint(0, n_cats, (3, 40), generator=g)
    asked = torch.arange(Q).repeat(3, 1)  # every row, the padding and unknown ones too
    with torch.no_grad():
        ours, theirs = served.init_state(3), model.init_state(3)
        for t in range(40):
            a, b = served.readout(ours, asked), model.readout(theirs, asked)
            for field in FIELDS:
                torch.testing.assert_close(getattr(a, field), getattr(b, field), atol=2e-5, rtol=0)
            ours, theirs = served.step(ours, q[:, t], r[:, t]), model.step(theirs, q[:, t], r[:, t])
            torch.testing.assert_close(ours[0], theirs[0], atol=5e-5, rtol=0)
    assert theirs[0].min() < -10.0  # (the evidence is far from trivially small)


def test_the_served_form_gives_way_past_the_table_limit(monkeypatch):
    from nextstep.models import deep_gpcm as family

    model = BayesGPCM(GPCMConfig(n_questions=30, n_cats=K, key_dim=8)).eval()
    assert isinstance(model.for_serving(), family.TabulatedBayesGPCM)
    monkeypatch.setattr(family, "TABLE_LIMIT", 30 * (K * 61 + 1 + K) - 1)  # one float short of the tables
    assert model.for_serving() is model
