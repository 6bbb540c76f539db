"""The building blocks of the Deep-GPCM family against hand-computed values and their defining formulas."""

import pytest
import torch

from nextstep.models.layers.attention import CausalRefinement
from nextstep.models.layers.memory import DKVMN
from nextstep.models.layers.ordinal import (
    CORALBlend,
    OrdinalResponseEmbedding,
    Thresholds,
    gpcm_logits,
    linear_decay_weights,
)

# ----------------------------------------------------------------------------- ordinal embedding


def test_linear_decay_weights_hand_table():
    expected = torch.tensor([
        [1, 2 / 3, 1 / 3, 0],
        [2 / 3, 1, 2 / 3, 1 / 3],
        [1 / 3, 2 / 3, 1, 2 / 3],
        [0, 1 / 3, 2 / 3, 1],
    ])
    w = linear_decay_weights(4)
    assert w.shape == (4, 4) and w.dtype == torch.float32
    torch.testing.assert_close(w, expected, rtol=0, atol=1e-7)
    torch.testing.assert_close(w[1], torch.tensor([2 / 3, 1, 2 / 3, 1 / 3]), rtol=0, atol=1e-7)
    assert torch.equal(linear_decay_weights(2), torch.eye(2))
    three = torch.tensor([[1, 0.5, 0], [0.5, 1, 0.5], [0, 0.5, 1]])
    torch.testing.assert_close(linear_decay_weights(3), three)


def _seed_one_hot(q: int, r: int, n_questions: int, n_cats: int, weights: torch.Tensor) -> torch.Tensor:
    """The seed's input vector x in R^{Q*K}: x[k*Q + q] = w[r, k], all other entries 0."""
    x = torch.zeros(n_cats * n_questions)
    for k in range(n_cats):
        x[k * n_questions + q] = weights[r, k]
    return x


@pytest.mark.parametrize("learnable", [False, True])
def test_ordinal_embedding_equals_one_hot_times_dense_matrix(learnable):
    Q, K, d = 7, 4, 5
    torch.manual_seed(0)
    emb = OrdinalResponseEmbedding(Q, K, d, learnable=learnable)
    if learnable:
        with torch.no_grad():  # move away from the initial pattern so the learned weights are exercised
            emb.decay_logits.add_(torch.randn(K, K))
        weights = torch.softmax(emb.decay_logits.detach(), dim=-1)
    else:  # written out by hand, independently of linear_decay_weights
        weights = torch.tensor([[max(0.0, 1 - abs(k - r) / (K - 1)) for k in range(K)] for r in range(K)])
    dense = emb.table.weight.detach()  # (Q*K, d): the seed's dense matrix, row k*Q + q
    qs, rs = torch.meshgrid(torch.arange(Q), torch.arange(K), indexing="ij")
    qs, rs = qs.reshape(-1), rs.reshape(-1)
    with torch.no_grad():
        got = emb(qs, rs)  # (Q*K, d)
        got_2d = emb(qs.view(4, 7), rs.view(4, 7))  # any leading shape
    expected = torch.stack([_seed_one_hot(int(q), int(r), Q, K, weights) @ dense
                            for q, r in zip(qs, rs, strict=True)])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_2d.reshape(-1, d), expected, rtol=1e-5, atol=1e-6)


def test_learnable_decay_starts_at_the_linear_decay_pattern():
    emb = OrdinalResponseEmbedding(5, 4, 3, learnable=True)
    base = linear_decay_weights(4) + 1e-2
    torch.testing.assert_close(emb.weights().detach(), base / base.sum(-1, keepdim=True))
    assert (emb.weights().argmax(-1) == torch.arange(4)).all()
    assert any(n == "decay_logits" for n, _ in emb.named_parameters())
    fixed = OrdinalResponseEmbedding(5, 4, 3)
    assert all(n == "table.weight" for n, _ in fixed.named_parameters())  # fixed weights are a buffer


# ----------------------------------------------------------------------------- GPCM and thresholds


def test_gpcm_logits_hand_example():
    theta, alpha, beta = torch.tensor(0.5), torch.tensor(2.0), torch.tensor([-1.0, 0.0, 1.0])
    torch.testing.assert_close(gpcm_logits(theta, alpha, beta), torch.tensor([0.0, 3.0, 4.0, 3.0]))
    # batched: (2, 3) items, each a different example
    theta_b = torch.tensor([[0.5, 0.0, 1.0], [0.5, -1.0, 2.0]])
    alpha_b = torch.tensor([[2.0, 1.0, 0.5], [1.0, 3.0, 1.0]])
    beta_b = torch.tensor([-1.0, 0.0, 1.0]).expand(2, 3, 3)
    logits = gpcm_logits(theta_b, alpha_b, beta_b)
    assert logits.shape == (2, 3, 4)
    torch.testing.assert_close(logits[0, 0], torch.tensor([0.0, 3.0, 4.0, 3.0]))
    torch.testing.assert_close(logits[1, 0], torch.tensor([0.0, 1.5, 2.0, 1.5]))
    torch.testing.assert_close(logits[0, 1], torch.tensor([0.0, 1.0, 1.0, 0.0]))
    torch.testing.assert_close(logits[1, 1], torch.tensor([0.0, 0.0, -3.0, -9.0]))


def test_ordered_thresholds_are_strictly_increasing():
    torch.manual_seed(2)
    ordered, free = Thresholds(6, 3, ordered=True), Thresholds(6, 3, ordered=False)
    with torch.no_grad():
        ordered.linear.weight.mul_(3)  # raw gaps of either sign, a few units large
        free.linear.weight.copy_(ordered.linear.weight)
        free.linear.bias.copy_(ordered.linear.bias)
    x = torch.randn(50, 6)
    with torch.no_grad():
        b, raw = ordered(x), free(x)
    assert (b.diff(dim=-1) > 0).all()
    assert (raw.diff(dim=-1) < 0).any()  # the unordered head does produce out-of-order thresholds here
    torch.testing.assert_close(b[:, 0], raw[:, 0])  # the first threshold is the free one
    torch.testing.assert_close(b.diff(dim=-1), torch.nn.functional.softplus(raw[:, 1:]))


def test_ordered_thresholds_never_decrease_even_for_huge_negative_gaps():
    """softplus of a gap below about -15 is lost in float32 rounding: thresholds can tie, never swap."""
    th = Thresholds(1, 3, ordered=True)
    with torch.no_grad():
        th.linear.weight.fill_(0.0)
        th.linear.bias.copy_(torch.tensor([5.0, -200.0, -30.0]))
        b = th(torch.zeros(1, 1))
    assert (b.diff(dim=-1) >= 0).all()
    assert torch.isfinite(b).all()


# ----------------------------------------------------------------------------- CORAL blend


def _random_coral(K: int, seed: int):
    torch.manual_seed(seed)
    blend = CORALBlend(K)
    with torch.no_grad():
        for p in blend.parameters():
            p.add_(torch.randn_like(p))
    theta = torch.randn(6, 5) * 2
    alpha = torch.nn.functional.softplus(torch.randn(6, 5)) + 0.05
    beta = torch.randn(6, 5, K - 1) * 2
    gpcm = torch.log_softmax(gpcm_logits(theta, alpha, beta), dim=-1)
    return blend, theta, alpha, beta, gpcm


@pytest.mark.parametrize("K,seed", [(4, 0), (4, 1), (5, 2), (2, 3)])
def test_coral_blend(K, seed):
    blend, theta, alpha, beta, gpcm = _random_coral(K, seed)
    with torch.no_grad():
        tau = blend.tau()
        log_probs, cum_logits = blend(theta, alpha, beta, gpcm)
        w = blend.blend_weight(beta)
    assert tau.shape == (K - 1,)
    assert (tau.diff() > 0).all()
    # cumulative logits are alpha (theta - delta - tau_k): global tau shapes the categories, the item enters
    # only through its location delta = mean(beta), never through its individual thresholds
    delta = beta.mean(-1, keepdim=True)
    torch.testing.assert_close(cum_logits, alpha.unsqueeze(-1) * (theta.unsqueeze(-1) - delta - tau))
    above = torch.sigmoid(cum_logits)  # P(Y > k)
    assert (above.diff(dim=-1) <= 0).all()  # rank-consistent
    ones, zeros = torch.ones_like(above[..., :1]), torch.zeros_like(above[..., :1])
    coral = torch.cat([ones, above], -1) - torch.cat([above, zeros], -1)
    assert (coral >= 0).all()
    torch.testing.assert_close(coral.sum(-1), torch.ones(6, 5))
    assert w.shape == (6, 5)
    assert ((w > 0) & (w < 1)).all()
    probs = log_probs.exp()
    torch.testing.assert_close(probs.sum(-1), torch.ones(6, 5))
    expected = (1 - w).unsqueeze(-1) * gpcm.exp() + w.unsqueeze(-1) * coral
    torch.testing.assert_close(probs, expected, rtol=1e-5, atol=1e-6)


def test_coral_tau_at_initialisation_spans_minus_one_to_one():
    tau = CORALBlend(4).tau().detach()
    torch.testing.assert_close(tau, torch.tensor([-1.0, 0.0, 1.0]), rtol=0, atol=1e-5)


def test_coral_blend_weight_stays_inside_the_open_interval_for_extreme_thresholds():
    blend = CORALBlend(4)
    beta = torch.tensor([[-1e4, 0.0, 1e4], [0.0, 0.0, 0.0], [5.0, 5.0, 5.0], [-1.0, 0.0, 1.0]])
    with torch.no_grad():
        w = blend.blend_weight(beta)
    assert torch.isfinite(w).all()
    assert ((w > 0) & (w < 1)).all()
    # the score is clamped to [-3, 3] before the sigmoid
    low, high = torch.sigmoid(torch.tensor([-3.0, 3.0]))
    assert (w >= low - 1e-6).all() and (w <= high + 1e-6).all()


def test_coral_blend_weight_does_not_backpropagate_into_beta():
    blend, theta, alpha, beta, gpcm = _random_coral(4, 4)
    beta = beta.clone().requires_grad_(True)
    blend.blend_weight(beta).sum().backward()
    assert beta.grad is None  # detached, as section 7.2 asks
    assert blend.range_raw.grad is not None and blend.tau_raw.grad is not None


# ----------------------------------------------------------------------------- DKVMN memory


def test_dkvmn_write_on_one_slot():
    torch.manual_seed(0)
    B, N, dv = 2, 5, 3
    memory = torch.randn(B, N, dv)
    weights = torch.zeros(B, N)
    weights[0, 2] = 1.0
    weights[1, 4] = 1.0
    a = torch.tensor([[0.3, -0.7, 0.9], [-0.2, 0.1, 0.5]])
    new = DKVMN.write(memory, weights, torch.ones(B, dv), a)
    torch.testing.assert_close(new[0, 2], a[0], rtol=0, atol=0)
    torch.testing.assert_close(new[1, 4], a[1], rtol=0, atol=0)
    untouched = torch.ones(B, N, dtype=torch.bool)
    untouched[0, 2] = untouched[1, 4] = False
    assert torch.equal(new[untouched], memory[untouched])
    # erase 0 and add 0 change nothing; a half weight erases and adds half
    assert torch.equal(DKVMN.write(memory, weights, torch.zeros(B, dv), torch.zeros(B, dv)), memory)
    half = weights * 0.5
    e = torch.full((B, dv), 0.4)
    got = DKVMN.write(memory, half, e, a)
    torch.testing.assert_close(got[0, 2], memory[0, 2] * (1 - 0.5 * 0.4) + 0.5 * a[0])
    assert torch.equal(got[0, :2], memory[0, :2])


def test_dkvmn_read_and_address():
    torch.manual_seed(0)
    mem = DKVMN(memory_size=6, key_dim=4, value_dim=3)
    memory = torch.randn(2, 6, 3)
    one_hot = torch.zeros(2, 6)
    one_hot[0, 1] = one_hot[1, 5] = 1.0
    torch.testing.assert_close(DKVMN.read(memory, one_hot), torch.stack([memory[0, 1], memory[1, 5]]))
    w = torch.softmax(torch.randn(2, 4, 6), dim=-1)  # (B, M, N)
    torch.testing.assert_close(DKVMN.read(memory, w), torch.einsum("bmn,bnd->bmd", w, memory))
    with torch.no_grad():
        addr = mem.address(torch.randn(3, 7, 4))
        erase, add = mem.erase_add(torch.randn(3, 3) * 5)
    assert addr.shape == (3, 7, 6) and (addr > 0).all()
    torch.testing.assert_close(addr.sum(-1), torch.ones(3, 7))
    assert ((erase >= 0) & (erase <= 1)).all() and ((add >= -1) & (add <= 1)).all()
    init = mem.initial(3)
    assert init.shape == (3, 6, 3) and torch.equal(init[2], mem.init_value_memory.detach())


# ----------------------------------------------------------------------------- causal refinement


@pytest.mark.parametrize("window,T", [(3, 9), (5, 4), (1, 5)])
def test_causal_refinement_step_equals_band_masked_forward(window, T):
    torch.manual_seed(0)
    refine = CausalRefinement(dim=8, n_heads=2, n_cycles=2, window=window).eval()
    x = torch.randn(2, T, 8)
    with torch.no_grad():
        full = refine(x)
        windows, count = refine.initial(2)
        assert windows.shape == (2, 2, window, 8) and count.tolist() == [0, 0]
        for t in range(T):
            h, windows, count = refine.step(windows, count, x[:, t])
            torch.testing.assert_close(h, full[:, t], rtol=0, atol=1e-5)
        assert count.tolist() == [T, T]


def test_causal_refinement_band_mask_limits_what_a_position_sees():
    """Each cycle sees W positions back, so after C cycles position t depends on t - C(W-1) .. t only."""
    torch.manual_seed(0)
    W, C, T = 3, 2, 10
    refine = CausalRefinement(dim=8, n_heads=2, n_cycles=C, window=W).eval()
    x = torch.randn(1, T, 8)
    with torch.no_grad():
        base = refine(x)
        for s in range(T):
            x2 = x.clone()
            x2[:, s] += torch.randn(8)
            moved = (refine(x2) - base).abs().amax(-1)[0]  # (T,)
            for t in range(T):
                if t < s or t - s > C * (W - 1):
                    assert moved[t] == 0, (s, t)
                else:
                    assert moved[t] > 1e-6, (s, t)
