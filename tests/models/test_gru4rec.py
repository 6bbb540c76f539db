"""GRU4Rec and the count baselines: input modes, initialisation, the streaming API, no future leak."""

import pytest
import torch

from nextstep.models.gru4rec import GRU4Rec, GRU4RecConfig
from nextstep.models.next_item import Markov, Popularity

V = 40
MODES = {"constrained": {}, "embedding": {"constrained_embedding": False, "embedding": 12},
         "one_hot": {"constrained_embedding": False, "embedding": 0}}


def model(mode="constrained", layers=(16,), **kw):
    torch.manual_seed(0)
    return GRU4Rec(GRU4RecConfig(n_items=V, layers=layers, **MODES[mode], **kw)).eval()


def batch(B=3, T=7, seed=0):
    return torch.randint(2, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("layers", [(16,), (16, 8)])
def test_stepping_equals_the_full_session_pass(mode, layers):
    m, items = model(mode, layers), batch()
    full = m(items)
    assert full.shape == (3, 7, V)
    state = m.init_state(3)
    for t in range(7):
        state = m.step(state, items[:, t])
        torch.testing.assert_close(m.scores(state), full[:, t], atol=1e-6, rtol=0)
    # forward is the step loop, so also check it against an independent full-sequence pass: torch.nn.GRU
    # over the whole session with the same weights (the one-hot first layer has no input matrix to copy)
    if m.one_hot or len(layers) > 1:
        return
    gru = torch.nn.GRU(m.gru[0].w_ih.shape[1], layers[0], batch_first=True)
    with torch.no_grad():
        gru.weight_ih_l0.copy_(m.gru[0].w_ih)
        gru.weight_hh_l0.copy_(m.gru[0].w_hh)
        gru.bias_ih_l0.copy_(m.gru[0].b_ih)
        gru.bias_hh_l0.copy_(m.gru[0].b_hh)
        hidden, _ = gru(m.embed(items))
        w = m.out.weight
        torch.testing.assert_close(hidden @ w[:, :-1].t() + w[:, -1], full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_no_future_leak(mode):
    m, items = model(mode), batch()
    changed = items.clone()
    changed[:, 4:] = torch.randint(2, V, changed[:, 4:].shape)
    torch.testing.assert_close(m(items)[:, :4], m(changed)[:, :4], atol=0, rtol=0)


def test_glorot_uniform_weights_and_zero_biases():
    m = model("embedding", layers=(16,))
    bound = (6 / (V + 16)) ** 0.5
    assert m.out.weight[:, :-1].abs().max() <= bound and (m.out.weight[:, -1] == 0).all()
    w = m.gru[0].w_ih
    assert w[:16].abs().max() <= (6 / (12 + 16)) ** 0.5 and w.abs().max() > 0.5 * (6 / (12 + 16)) ** 0.5
    assert (m.gru[0].b_hh == 0).all() and (m.gru[0].b_ih == 0).all()


def test_dropout_is_separate_for_embedding_and_hidden_and_off_in_eval():
    m = model(dropout_embed=0.3, dropout_hidden=0.5)
    assert m.drop_embed.p == 0.3 and m.drop_hidden.p == 0.5 and m.drop_embed is not m.drop_hidden
    items = batch()
    torch.testing.assert_close(m(items), m(items), atol=0, rtol=0)


def test_recommend_leaves_out_padding_unknown_and_excluded_rows_best_first():
    m, items = model(), batch()
    state = m.step(m.init_state(3), items[:, 0])
    exclude = torch.cat([items[:, :3], torch.zeros(3, 2, dtype=torch.long)], 1)
    rows, values = m.readout(state, exclude, k=V - 2 - 3)
    for b in range(3):
        assert not set(rows[b].tolist()) & ({0, 1} | set(items[b, :3].tolist()))
    assert (values[:, :-1] >= values[:, 1:]).all()
    scores = m.scores(state)
    torch.testing.assert_close(values, scores.gather(1, rows))


def test_config_is_validated():
    with pytest.raises(ValueError, match="dropout_hidden"):
        GRU4RecConfig(n_items=V, dropout_hidden=1.0)
    with pytest.raises(ValueError, match="layers"):
        GRU4RecConfig(n_items=V, layers=())
    with pytest.raises(ValueError, match="n_items"):
        GRU4RecConfig(n_items=2)


def test_popularity_ignores_the_session_and_markov_follows_the_last_item():
    items = torch.tensor([2, 3, 2, 3, 4, 2, 3]).numpy()
    offsets = torch.tensor([0, 2, 5, 7]).numpy()  # sessions [2,3] [2,3,4] [2,3]
    pop = Popularity.fit(items, 6)
    assert pop.scores((torch.tensor([4]),)).tolist() == [[0, 0, 3, 3, 1, 0]]
    mk = Markov.fit(items, offsets, 6)
    after3 = mk.scores((torch.tensor([3]),))[0]
    assert after3.argmax().item() == 4 and 1 <= after3[4] < 2  # one 3->4 transition (+ popularity share)
    assert after3[2] < 1  # 3 -> 2 only across sessions: no transition
    cold = mk.scores((torch.tensor([0]),))[0]
    assert cold.argmax().item() in (2, 3) and cold.max() < 1  # no last item: popularity order


def test_markov_width_keeps_the_most_frequent_successors():
    items = torch.tensor([2, 3, 2, 3, 2, 4, 2, 5, 2, 5]).numpy()
    offsets = torch.arange(0, 11, 2).numpy()
    mk = Markov.fit(items, offsets, 7, width=2)
    s = mk.scores((torch.tensor([2]),))[0]
    assert s[3] >= 2 and s[5] >= 2 and s[4] < 1  # 2->4 seen once: beyond the width of 2


def test_dropout_keeps_the_expected_value_and_drops_the_share_asked():
    from nextstep.models.gru4rec import Dropout

    d = Dropout(0.4).train()
    x = torch.ones(200, 500)
    y = d(x)
    assert abs((y == 0).float().mean().item() - 0.4) < 0.01
    assert abs(y.mean().item() - 1.0) < 0.02
    torch.testing.assert_close(torch.unique(y), torch.tensor([0.0, 1 / 0.6]))
    assert torch.equal(d.eval()(x), x)
