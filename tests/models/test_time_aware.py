"""The time-aware transformer: last-row serving equals the full-sequence pass, no future leak, head groups."""

import itertools

import numpy as np
import pytest
import torch

from nextstep.models import fsrs
from nextstep.models.time_aware import Query, TimeAwareConfig, TimeAwareTransformer, Window, coral_loss
from nextstep.srs.review_window import select, user_windows

B, T = 3, 14


def _sequences(seed=0, b=B, t=T, n_cards=4) -> Window:
    g = torch.Generator().manual_seed(seed)
    card = torch.randint(0, n_cards, (b, t), generator=g)
    time = 1.7e9 + torch.cumsum(torch.rand(b, t, generator=g, dtype=torch.float64) * 86400 * 2, 1)
    duration = torch.rand(b, t, generator=g) * 20
    duration[0, 2] = float("nan")  # unknown durations are an input, not an error
    error = torch.rand(b, t, generator=g) - 0.5  # FSRS-6's errors as a window carries them, NaN where unscored
    error[torch.rand(b, t, generator=g) < 0.3] = float("nan")
    return Window(card, card % 2, time, torch.randint(1, 5, (b, t), generator=g), duration,
                  torch.randint(-1, 4, (b, t), generator=g), torch.ones(b, t, dtype=torch.bool), error)


def prefix_window(sequence: Window, i: int, error: torch.Tensor | None = None) -> Window:
    """Rows 0..i-1 of (B, T) sequences as windows left-padded to T (what a query at row i sees), with each row's
    FSRS-6 error from `error` (B, T) (default: the sequence's own)."""
    B, T = sequence.card.shape
    error = sequence.error if error is None else error
    fills = (0, 0, 0.0, 1, 0.0, -1, False, float("nan"))
    return Window(*(torch.cat([torch.full((B, T - i), f, dtype=x.dtype), x[:, :i]], dim=1)
                    for x, f in zip((*sequence[:7], error), fills, strict=True)))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = TimeAwareTransformer(TimeAwareConfig(d_model=32, ffn_dim=64, card_heads=2, deck_heads=1, global_heads=1,
                                             deck_drift_gain=3.0, evidence_prior=None))  # the network alone (`mixed`)
    with torch.no_grad():  # make every head and bias matter (an untrained model's curve is FSRS-6's alone)
        for layer in m.layers:
            layer.attn.decay_w.fill_(1.5)
        torch.nn.init.normal_(m.curve_head.weight, std=0.3)
        torch.nn.init.normal_(m.time_head.weight, std=0.3)
    return m.eval()


def test_last_row_serving_equals_full_sequence(model):
    seq = _sequences()
    full = model(seq)
    assert full.rating_probs.shape == (B, T, 4)
    drift, error = torch.zeros(B, 2), torch.full((B, T), float("nan"))
    for i in range(T):
        last = model.readout((*prefix_window(seq, i, error), drift), seq.card[:, i], seq.deck[:, i], seq.time[:, i])
        torch.testing.assert_close(last.rating_probs, full.rating_probs[:, i], atol=1e-5, rtol=0)
        torch.testing.assert_close(last.log_duration, full.log_duration[:, i], atol=1e-5, rtol=0)
        torch.testing.assert_close(last.recall, 1 - last.rating_probs[:, 0], atol=1e-6, rtol=0)
        drift = model.drift_update(drift, last, seq.rating[:, i])
        error[:, i] = model.row_error(last, seq.rating[:, i])
    assert float(drift[:, 1].min()) > 0  # every user's drift counted scored reviews, so the test compared it
    # and some decks' rows had errors before a later query of the same deck, so the deck's drift was compared too
    assert bool((~torch.isnan(error[:, :-1]) & (seq.deck[:, :-1] == seq.deck[:, -1:])).any())


def test_drift_is_fsrs6s_recent_error_and_moves_recall_the_same_way(model):
    """The drift sums are FSRS-6's errors on scored reviews, each weight halving every `drift_halflife` scored
    reviews; a user recalling more than FSRS-6 expects gets a higher P(recall) at every elapsed time."""
    seq = _sequences(3)
    state = model.init_state(B)
    a = 0.5 ** (1 / model.cfg.drift_halflife)
    m, w = torch.zeros(B, dtype=torch.float64), torch.zeros(B, dtype=torch.float64)
    for i in range(T):
        p = model.readout(state, seq.card[:, i], seq.deck[:, i], seq.time[:, i])
        y = (seq.rating[:, i] > 1).double()
        m = torch.where(p.scored, a * m + y - p.fsrs_recall.double(), m)
        w = torch.where(p.scored, a * w + 1, w)
        state = model.step(state, *(field[:, i] for field in seq[:6]))
        torch.testing.assert_close(state[8].double(), torch.stack([m, w], -1), atol=1e-5, rtol=0)
    later = seq.time[:, -1] + torch.tensor([3.0, 10.0, 40.0], dtype=torch.float64) * 86400
    card, deck = seq.card[:, -1], seq.deck[:, -1]
    up = (*state[:8], torch.tensor([[2.0, 3.0]] * B))
    down = (*state[:8], torch.tensor([[-2.0, 3.0]] * B))
    assert bool((model.readout(up, card, deck, later).recall > model.readout(down, card, deck, later).recall).all())


def test_stepping_reviews_into_the_window_state_equals_full_sequence(model):
    seq = _sequences(5)
    full = model(seq)
    state = model.init_state(B)  # the window (H = 64 rows) holds every earlier review of these T-row sequences
    for i in range(T):
        out = model.readout(state, seq.card[:, i], seq.deck[:, i], seq.time[:, i])
        torch.testing.assert_close(out.rating_probs, full.rating_probs[:, i], atol=1e-5, rtol=0)
        torch.testing.assert_close(out.log_duration, full.log_duration[:, i], atol=1e-5, rtol=0)
        state = model.step(state, *(field[:, i] for field in seq[:6]))
    assert [list(x.shape) for x in state] == [[B, *s["shape"]] for s in model.state_spec()]


def test_no_future_leak(model):
    seq = _sequences(1)
    base = model(seq)
    for t in range(T):
        changed = [x.clone() for x in seq[:7]]
        g = torch.Generator().manual_seed(t)
        changed[1][:, t:] = torch.randint(0, 5, (B, T - t), generator=g)  # deck
        changed[3][:, t:] = torch.randint(1, 5, (B, T - t), generator=g)  # rating
        changed[4][:, t:] = torch.rand(B, T - t, generator=g) * 99  # duration
        changed[5][:, t:] = torch.randint(-1, 4, (B, T - t), generator=g)  # state
        if t + 1 < T:  # card and time of later reviews (time stays increasing)
            changed[0][:, t + 1:] = torch.randint(0, 9, (B, T - t - 1), generator=g)
            changed[2][:, t + 1:] = changed[2][:, t + 1:] + 1234.5
        out = model(Window(*changed))
        torch.testing.assert_close(out.rating_probs[:, :t], base.rating_probs[:, :t], atol=0, rtol=0)
        torch.testing.assert_close(out.log_duration[:, :t], base.log_duration[:, :t], atol=0, rtol=0)
        # the prediction at t sees only t's card, deck and time: rating, duration and state at t do not enter
        same_query = [x.clone() for x in seq[:7]]
        same_query[3][:, t:] = changed[3][:, t:]
        same_query[4][:, t:] = changed[4][:, t:]
        same_query[5][:, t:] = changed[5][:, t:]
        out = model(Window(*same_query))
        torch.testing.assert_close(out.rating_probs[:, :t + 1], base.rating_probs[:, :t + 1], atol=0, rtol=0)
        torch.testing.assert_close(out.log_duration[:, :t + 1], base.log_duration[:, :t + 1], atol=0, rtol=0)


def test_the_query_card_deck_and_time_matter(model):
    seq = _sequences(2)
    w, card, deck, time = prefix_window(seq, T - 1), seq.card[:, -1], seq.deck[:, -1], seq.time[:, -1]
    base = model.readout(w, card, deck, time).rating_probs
    assert not torch.allclose(model.readout(w, card, deck, time + 30 * 86400).rating_probs, base)
    assert not torch.allclose(model.readout(w, card + 100, deck, time).rating_probs, base)
    assert not torch.allclose(model.readout(w, card, deck + 100, time).rating_probs, base)


def test_padding_and_an_empty_window(model):
    seq = _sequences(3)
    w = prefix_window(seq, 5, torch.rand(B, T) - 0.5)
    out = model.readout(w, seq.card[:, 5], seq.deck[:, 5], seq.time[:, 5])
    # garbage in padded rows changes nothing
    garbage = Window(torch.where(w.valid, w.card, 7), torch.where(w.valid, w.deck, 7),
                     torch.where(w.valid, w.time, 9e9), torch.where(w.valid, w.rating, 4),
                     torch.where(w.valid, w.duration, 1e6), torch.where(w.valid, w.state, 3), w.valid,
                     torch.where(w.valid, w.error, 0.7))
    again = model.readout(garbage, seq.card[:, 5], seq.deck[:, 5], seq.time[:, 5])
    torch.testing.assert_close(again.rating_probs, out.rating_probs, atol=1e-6, rtol=0)
    empty = model.readout(prefix_window(seq, 0), seq.card[:, 0], seq.deck[:, 0], seq.time[:, 0])
    assert torch.isfinite(empty.rating_probs).all() and torch.isfinite(empty.log_duration).all()
    torch.testing.assert_close(empty.rating_probs.sum(-1), torch.ones(B), atol=1e-6, rtol=0)


def test_coral_probabilities_are_ordered_and_loss_matches_formula(model):
    pred = model(_sequences(4))
    assert (pred.rating_probs >= 0).all()
    torch.testing.assert_close(pred.rating_probs.sum(-1), torch.ones(B, T), atol=1e-6, rtol=0)
    above = torch.sigmoid(pred.threshold_logits.double())  # float64: log(1 - above) near above = 1
    assert (above[..., :-1] >= above[..., 1:]).all()  # P(rating > 1) >= P(rating > 2) >= P(rating > 3)
    rating = torch.tensor([[1, 2, 3, 4] * 3 + [1, 2]] * B)
    manual = 0.0
    for k in range(3):
        y = (rating > k + 1).float()
        manual = manual - (y * torch.log(above[..., k]) + (1 - y) * torch.log(1 - above[..., k]))
    torch.testing.assert_close(coral_loss(pred, rating).double(), manual.mean(), atol=1e-5, rtol=0)


def test_window_rule_keeps_the_cards_history():
    # 10 earlier reviews; the query card was reviewed at 1 and 3 and 8; window 4 with 2 card rows
    assert select(np.array([1, 3, 8]), 10, 4, 2).tolist() == [3, 7, 8, 9]
    assert select(np.array([1, 3, 8]), 10, 4, 0).tolist() == [6, 7, 8, 9]
    assert select(np.array([7, 8]), 10, 4, 2).tolist() == [6, 7, 8, 9]  # card rows already recent
    assert select(np.array([0, 1, 2, 3]), 10, 3, 5).tolist() == [1, 2, 3]  # card rows capped by the size
    assert select(np.array([], dtype=np.int64), 2, 4, 2).tolist() == [0, 1]
    cards = np.array([0, 1, 2, 0, 3, 4, 5, 0, 6, 1])
    win = user_windows(cards, 4, 2)
    for i in range(len(cards)):
        expect = select(np.flatnonzero(cards[:i] == cards[i]), i, 4, 2)
        assert win[i][win[i] >= 0].tolist() == expect.tolist()
        assert (win[i][: 4 - len(expect)] == -1).all()


@pytest.fixture(scope="module")
def curved():
    """A model whose every curve term and time term carries weight (random, large), so that a rising term
    anywhere would show."""
    torch.manual_seed(1)
    m = TimeAwareTransformer(TimeAwareConfig(d_model=32, ffn_dim=64))
    with torch.no_grad():
        m.curve_head.weight.normal_(0, 0.5)
        m.curve_head.bias.normal_(0, 1.0)
        m.time_head.weight.normal_(0, 0.5)
        m.time_head.bias.normal_(0, 1.0)
        m.calibration.copy_(torch.tensor([1.3, -0.2]))
    return m.eval()


def test_recall_never_rises_with_the_time_since_the_cards_last_review(curved):
    """For every window and card (seen or not), P(recall) over 400 random times from 1 minute to 10 years
    after the window's last review never rises; each seen card's does fall."""
    seq = _sequences(4, b=3, t=T, n_cards=5)
    offsets = torch.from_numpy(np.sort(np.exp(np.random.default_rng(0).uniform(np.log(60), np.log(3.2e8), 400))))
    with torch.no_grad():
        for b in range(3):
            w = Window(*(x[b:b + 1].expand(len(offsets), -1) for x in seq))
            for card in range(6):  # card 5 never appears
                q = torch.full((len(offsets),), card)
                recall = curved.readout(w, q, q % 2, seq.time[b, -1] + offsets).recall
                assert float(torch.diff(recall).max()) <= 1e-6, (b, card)
                assert card == 5 or float(recall[0]) > float(recall[-1]), (b, card)


def test_schedule_is_the_curves_inverse(curved):
    seq = _sequences(5)
    w, card, deck = Window(*seq), seq.card[:, 2], seq.deck[:, 2]
    now = seq.time[:, -1] + 3600
    dues = []
    with torch.no_grad():
        for retention in (0.97, 0.9, 0.7, 0.4):
            recall, log_wait, _ = curved.schedule(w, card, deck, now, torch.full((B,), retention))
            wait = torch.expm1(log_wait) * 86400
            at_due = curved.readout(w, card, deck, now + wait).recall
            assert torch.allclose(at_due, recall, atol=1e-6)
            later = wait > 0  # due later: the recall there is the retention; due now: already at or below it
            assert torch.allclose(recall[later], torch.full_like(recall[later], retention), atol=1e-4)
            assert (curved.readout(w, card, deck, now).recall[~later] <= retention + 1e-6).all()
            dues.append(wait)
    assert all((a <= b + 1e-3).all() for a, b in zip(dues, dues[1:], strict=False))  # lower retention, later


def test_the_curve_starts_at_fsrs6_and_is_fsrs6_at_blend_zero():
    """At blend 0 a seen card's P(recall) is FSRS-6's, from the card's reviews in the window (fsrs-rs itself as
    the reference); an untrained model is within a hair of it (corrections start at nothing)."""
    fsrs_rs = pytest.importorskip("fsrs_rs_python")
    torch.manual_seed(0)
    m = TimeAwareTransformer(TimeAwareConfig(d_model=32, ffn_dim=64)).eval()
    w = [0.5, 1.5, 4.0, 12.0, 5.5, 0.6, 1.8, 0.02, 1.3, 0.25, 0.9, 1.8, 0.1, 0.4, 1.2, 0.4, 2.2, 0.7, 0.2, 0.1, 0.35]
    m.fsrs_w.copy_(torch.tensor(w))
    seq = _sequences(7, b=4, t=20, n_cards=3)
    wanted, got, untrained = [], [], []
    for i in range(1, 20):
        win = prefix_window(seq, i)._replace(error=None)  # raw reviews: no drift of any kind
        with torch.no_grad():
            m.blend.fill_(1.0)
            untrained.append(m.readout(win, seq.card[:, i], seq.deck[:, i], seq.time[:, i]).recall)
            m.blend.fill_(0.0)
            got.append(m.readout(win, seq.card[:, i], seq.deck[:, i], seq.time[:, i]).recall)
        for b in range(4):
            rows = [j for j in range(i) if seq.card[b, j] == seq.card[b, i]]
            if not rows:
                wanted.append(float("nan"))
                continue
            start = torch.tensor([m.cfg.day_start_hour * 3600.0], dtype=torch.float64)  # the default boundary
            days = [int(m._day(seq.time[b, j:j + 1], start)) for j in rows]
            reviews = [fsrs_rs.FSRSReview(int(seq.rating[b, j]), 0 if k == 0 else days[k] - days[k - 1])
                       for k, j in enumerate(rows)]
            s = fsrs_rs.FSRS(w).memory_state(fsrs_rs.FSRSItem(reviews)).stability
            t = int(m._day(seq.time[b, i:i + 1], start)) - days[-1]
            wanted.append((1 + (0.9 ** (-1 / w[20]) - 1) * t / s) ** (-w[20]))
    wanted = torch.tensor(wanted).view(19, 4)
    seen = ~torch.isnan(wanted)
    assert int(seen.sum()) > 40
    torch.testing.assert_close(torch.stack(got)[seen], wanted[seen].float(), atol=1e-5, rtol=0)
    assert float((torch.stack(untrained)[seen] - wanted[seen]).abs().max()) < 0.01


W_OTHER = [0.5, 1.5, 4.0, 12.0, 5.5, 0.6, 1.8, 0.02, 1.3, 0.25, 0.9, 1.8, 0.1, 0.4, 1.2, 0.4, 2.2, 0.7, 0.2, 0.1, 0.35]


def _user_params(b=B) -> torch.Tensor:
    """(b, 21): every other row with other FSRS-6 parameters than the defaults."""
    from nextstep.models.fsrs import DEFAULT_W
    return torch.tensor([W_OTHER if i % 2 else list(DEFAULT_W) for i in range(b)], dtype=torch.float32)


def test_each_rows_fsrs6_parameters_are_an_input_not_a_weight(model):
    """One model, two users: each row's P(recall) is what the model gives with that row's user's parameters as its
    own defaults, whatever the other rows' parameters (a row's parameters never leak into another's)."""
    seq = _sequences(11)
    params = _user_params()
    state = model.init_state(B)
    torch.testing.assert_close(state[9][0], model.fsrs_w.float())  # a new user starts from the defaults
    state = (*state[:9], params)
    for i in range(T):
        state = model.step(state, *(field[:, i] for field in seq[:6]))
        assert torch.equal(state[9], params)  # a review does not change the parameters (a refit does)
    later = seq.time[:, -1] + 5 * 86400
    mixed = model.readout(state, seq.card[:, -1], seq.deck[:, -1], later)
    kept = model.fsrs_w.clone()
    try:
        for b in range(B):
            with torch.no_grad():
                model.fsrs_w.copy_(params[b])
            alone = model.readout(tuple(x[b:b + 1] for x in state[:9]), seq.card[b:b + 1, -1], seq.deck[b:b + 1, -1],
                                  later[b:b + 1])
            torch.testing.assert_close(mixed.recall[b:b + 1], alone.recall, atol=1e-6, rtol=0)
            torch.testing.assert_close(mixed.fsrs_recall[b:b + 1], alone.fsrs_recall, atol=1e-6, rtol=0)
    finally:
        with torch.no_grad():
            model.fsrs_w.copy_(kept)
    same = (*state[:9], params[[0, 0, 0]])
    assert not torch.allclose(mixed.recall, model.readout(same, seq.card[:, -1], seq.deck[:, -1], later).recall)


def test_stepping_equals_the_full_pass_with_each_users_parameters(model):
    seq = _sequences(13)
    params = _user_params()
    full = model(seq, params)
    state = (*model.init_state(B)[:9], params)
    for i in range(T):
        out = model.readout(state, seq.card[:, i], seq.deck[:, i], seq.time[:, i])
        torch.testing.assert_close(out.rating_probs, full.rating_probs[:, i], atol=1e-5, rtol=0)
        torch.testing.assert_close(out.fsrs_recall, full.fsrs_recall[:, i], atol=1e-6, rtol=0)
        state = model.step(state, *(field[:, i] for field in seq[:6]))
    assert not torch.allclose(full.fsrs_recall[1], model(seq).fsrs_recall[1])  # row 1's own parameters mattered


def test_each_users_day_boundary_decides_same_day_and_stepping_equals_the_full_pass(model):
    """A review at 02:00 UTC of a card last seen at 23:00 UTC the day before is on the card's next scheduler day for a
    user whose days start at midnight UTC, and on the same day for one whose days start at 04:00 UTC (Anki's
    default); the rest of a row's answer follows its own user's boundary, never another row's."""
    day0 = 1_700_006_400.0  # 00:00 UTC
    t = torch.tensor([[day0 - 3600.0, day0 + 2 * 3600.0]] * 2, dtype=torch.float64)  # 23:00, then 02:00
    w = Window(torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long), t[:, :1],
               torch.full((2, 1), 3), torch.full((2, 1), 5.0), torch.full((2, 1), 2),
               torch.ones(2, 1, dtype=torch.bool), torch.full((2, 1), float("nan")))
    start = torch.tensor([0.0, 4 * 3600.0], dtype=torch.float64)
    state = (*w, torch.zeros(2, 2), model.fsrs_w.float().expand(2, -1), start)
    zero = torch.zeros(2, dtype=torch.long)
    out = model.readout(state, zero, zero, t[:, 1])
    assert out.scored.tolist() == [True, False]
    assert out.fsrs_recall[0] < out.fsrs_recall[1]  # a day of forgetting against none (FSRS-6 counts whole days)
    default = model.readout(tuple(state[:10]), zero, zero, t[:, 1])  # no boundary: the config's, 04:00 UTC
    torch.testing.assert_close(default.recall[1], out.recall[1], atol=0, rtol=0)

    seq = _sequences(17)
    start = torch.tensor([0.0, 4 * 3600.0, 20 * 3600.0], dtype=torch.float64)
    full = model(seq, None, start)
    state = (*model.init_state(B)[:10], start)
    assert model.init_state(1)[10].item() == model.cfg.day_start_hour * 3600.0  # a new user: the config's
    for i in range(T):
        out = model.readout(state, seq.card[:, i], seq.deck[:, i], seq.time[:, i])
        torch.testing.assert_close(out.rating_probs, full.rating_probs[:, i], atol=1e-5, rtol=0)
        assert torch.equal(out.scored, full.scored[:, i])
        state = model.step(state, *(field[:, i] for field in seq[:6]))
        assert torch.equal(state[10], start)  # a review does not move the boundary
    moved = model(seq, None, start[[1, 1, 1]])
    assert not torch.equal(full.scored[2], moved.scored[2])  # row 2's own boundary mattered (its data cross 04:00)
    assert torch.equal(full.scored[1], moved.scored[1])


def test_a_given_card_memory_answers_as_the_window_computes_it_and_fsrs_rs_gives_the_same(model):
    """`readout` with the query card's FSRS-6 memory given (what the service's predict_memory graph takes) answers as
    it does computing the memory from the window (and a card without a review in the window reads none of it), and
    nextstep.srs.card_memory (fsrs-rs) gives that memory, with each user's own parameters and day boundary, also for
    cards with more reviews than the card window."""
    from nextstep.srs.card_memory import card_memory

    seq = _sequences(19, t=60, n_cards=3)  # 3 cards over 60 reviews: more than the card window of some
    params, start = _user_params(), torch.tensor([0.0, 4 * 3600.0, 20 * 3600.0], dtype=torch.float64)
    state = (*model.init_state(B)[:9], params, start)
    C = model.cfg.card_window
    for i in range(60):
        card, deck, t = seq.card[:, i], seq.deck[:, i], seq.time[:, i]
        seen = ((state[0] == card.unsqueeze(1)) & state[6]).any(1)
        memory = torch.where(seen.unsqueeze(1), model.card_memory(state, card, deck, t),
                             torch.tensor([1e3, 9.5]))  # a card without a review in the window: its memory is unread
        given = model.readout(state, card, deck, t, memory)
        out = model.readout(state, card, deck, t)
        for name in ("rating_probs", "recall", "log_duration", "fsrs_recall"):
            torch.testing.assert_close(getattr(given, name), getattr(out, name), atol=1e-6, rtol=0)
        assert torch.equal(given.scored, out.scored)
        if seen.any():
            for b in torch.nonzero(seen).flatten().tolist():
                valid = state[6][b].numpy()
                want = card_memory(state[0][b].numpy()[valid], state[2][b].numpy()[valid],
                                   state[3][b].numpy()[valid], int(card[b]), params[b].tolist(), float(start[b]), C)
                assert want == pytest.approx(memory[b].tolist(), rel=1e-4)
        state = model.step(state, *(field[:, i] for field in seq[:6]))
    assert int(((seq.card == seq.card[:, -1:]).sum(1)).max()) > C  # a card past the card window was asked
    rows = (np.array([1, 2]), np.array([0.0, 1.0]), np.array([3, 3]))
    assert card_memory(*rows, 5, fsrs.DEFAULT_W, 0.0, C) is None  # no review of the card: the graph computes it
    assert card_memory(*rows, 1, [float("nan")] * 21, 0.0, C) is None  # nor parameters fsrs-rs refuses
    w = fsrs.DEFAULT_W  # one Good review: FSRS-6's first stability and difficulty for Good
    assert card_memory(*rows, 1, w, 0.0, C) == pytest.approx((w[2], w[4] - np.exp(2 * w[5]) + 1), rel=1e-6)


@pytest.fixture(scope="module")
def shrunk():
    """The `model` fixture's weights with gap_shrink on, drifts off and the network's curve fully trusted."""
    torch.manual_seed(0)
    m = TimeAwareTransformer(TimeAwareConfig(d_model=32, ffn_dim=64, card_heads=2, deck_heads=1, global_heads=1,
                                             gap_shrink=True, interval_ratio_max=None, evidence_prior=None))
    with torch.no_grad():
        for layer in m.layers:
            layer.attn.decay_w.fill_(1.5)
        torch.nn.init.normal_(m.curve_head.weight, std=0.3)
        torch.nn.init.normal_(m.time_head.weight, std=0.3)
        m.curve_head.bias[0] += 1.5  # the network stretches FSRS-6's stability: what the shrink must hold back
        m.drift_gain.fill_(0.0)
        m.deck_drift_gain.fill_(0.0)
    return m.eval()


@pytest.mark.parametrize("factor", [1.0, 3.0])
def test_past_the_longest_gap_the_network_falls_as_fsrs6_does(shrunk, factor):
    """gap_shrink: beyond G, `gap_factor` times the longest interval between two reviews of a card in the window,
    P(recall) is the network's at G times FSRS-6's fall from G, so its ratio to FSRS-6's recall stays what it was at
    G; before G the network's own curve; never rising."""
    seq = _sequences(19, b=3, t=12)
    win = prefix_window(seq, 11)._replace(error=None)
    card, deck = seq.card[:, 11], seq.deck[:, 11]
    plain = TimeAwareTransformer(TimeAwareConfig(**{**shrunk.cfg.to_dict(), "gap_shrink": False})).eval()
    plain.load_state_dict(shrunk.state_dict())
    shrunk = TimeAwareTransformer(TimeAwareConfig(**{**shrunk.cfg.to_dict(), "gap_factor": factor})).eval()
    shrunk.load_state_dict(plain.state_dict())
    checked = 0
    for b in range(3):
        rows = [j for j in range(11) if seq.card[b, j] == card[b]]
        if not rows:
            continue
        gaps = [float(seq.time[b, j] - seq.time[b, i]) / 86400 for k in range(4) for i, j in
                itertools.pairwise([r for r in range(11) if seq.card[b, r] == k])]
        gap = max([1.0, *gaps]) * factor
        last = float(seq.time[b, rows[-1]])
        times = torch.tensor([last + gap * f * 86400 for f in (0.3, 1.0, 1.5, 3, 10, 100)], dtype=torch.float64)
        one = Window(*(x[b:b + 1].expand(len(times), -1) for x in win[:7]))
        with torch.no_grad():
            p = shrunk.readout(one, card[b].repeat(len(times)), deck[b].repeat(len(times)), times)
            q = plain.readout(one, card[b].repeat(len(times)), deck[b].repeat(len(times)), times)
        assert bool((p.recall[1:] <= p.recall[:-1] + 1e-6).all())
        ratio = p.recall / p.fsrs_recall
        torch.testing.assert_close(ratio[2:], ratio[1].expand(4), atol=2e-4, rtol=1e-3)  # past G: FSRS-6's fall
        torch.testing.assert_close(p.recall[:2], q.recall[:2], atol=1e-5, rtol=0)  # up to G: the network's own
        assert float((q.recall / q.fsrs_recall)[-1]) > float(ratio[-1]) + 1e-3  # without: the stretch goes on
        checked += 1
    assert checked >= 2


@pytest.mark.parametrize(("top", "floor"), [(2.0, 0.5), (3.0, None), (None, 0.5)])
def test_interval_ratio_bounds_keep_the_curve_between_fsrs6_slowed_and_sped_up(shrunk, top, floor):
    """interval_ratio_max a and _min b: R_FSRS(t / b) <= R(t) <= R_FSRS(t / a) at every elapsed time t (days; each
    bound widened to FSRS-6's own curve in whole scheduler days where that is outside it), never rising, and a bound
    is reached: the fixture's network stretches FSRS-6's stability 4.5 times, past a."""
    seq = _sequences(19, b=3, t=12)
    win = prefix_window(seq, 11)._replace(error=None)
    card, deck = seq.card[:, 11], seq.deck[:, 11]
    cfg = {**shrunk.cfg.to_dict(), "gap_shrink": False}
    plain = TimeAwareTransformer(TimeAwareConfig(**cfg)).eval()
    plain.load_state_dict(shrunk.state_dict())
    bounded = TimeAwareTransformer(TimeAwareConfig(**{**cfg, "interval_ratio_max": top,
                                                      "interval_ratio_min": floor})).eval()
    bounded.load_state_dict(shrunk.state_dict())
    checked = bound = 0
    for b in range(3):
        rows = [j for j in range(11) if seq.card[b, j] == card[b]]
        if not rows:
            continue
        last = float(seq.time[b, rows[-1]])
        days = torch.tensor([0.01, 0.5, 1, 2, 3.5, 7, 20, 60, 200, 1000], dtype=torch.float64)
        one = Window(*(x[b:b + 1].expand(len(days), -1) for x in win[:7]))
        query = (card[b].repeat(len(days)), deck[b].repeat(len(days)), last + days * 86400)
        with torch.no_grad():
            p, q = bounded.readout(one, *query), plain.readout(one, *query)
            _, ctx = plain._encode(one, Query(*(x.unsqueeze(1) for x in query)), one.valid.unsqueeze(1))

        def fsrs6(ratio, ctx=ctx, days=days):  # FSRS-6's recall at days / ratio, the card's state from the window
            log_r = fsrs.log_retrievability(ctx["decay"], ctx["fsrs_s"], (days / ratio).float().unsqueeze(1))
            return torch.exp(log_r).squeeze(1)

        assert bool((p.recall[1:] <= p.recall[:-1] + 1e-6).all())
        inside = torch.ones_like(q.recall, dtype=torch.bool)
        if top is not None:  # never past FSRS-6's own curve (whole scheduler days)
            upper = torch.maximum(fsrs6(top), q.fsrs_recall)
            assert bool((p.recall <= upper + 1e-5).all())
            inside &= q.recall <= upper
        if floor is not None:
            lower = torch.minimum(fsrs6(floor), q.fsrs_recall)
            assert bool((p.recall >= lower - 1e-5).all())
            inside &= q.recall >= lower
        torch.testing.assert_close(p.recall[inside], q.recall[inside], atol=1e-5, rtol=0)  # inside: the network's
        bound += int((~inside).sum())
        checked += 1
    assert checked >= 2 and (bound > 0 or top is None)


def test_the_default_bounds_intervals_at_twice_fsrs6s_without_the_gap_shrink(shrunk):
    """A model built with the default config (as `nextstep train` builds one) answers as the `shrunk` fixture's
    weights with gap_shrink off and interval_ratio_max 1.99 (twice FSRS-6's interval, less a margin for the
    schedule's search)."""
    rules = ("gap_shrink", "interval_ratio_max")
    cfg = {k: v for k, v in shrunk.cfg.to_dict().items() if k not in rules}
    default = TimeAwareTransformer(TimeAwareConfig(**cfg)).eval()
    assert (default.cfg.gap_shrink, default.cfg.interval_ratio_max, default.cfg.interval_ratio_min) == (False, 1.99,
                                                                                                        None)
    default.load_state_dict(shrunk.state_dict())
    bounded = TimeAwareTransformer(TimeAwareConfig(**cfg, gap_shrink=False, interval_ratio_max=1.99)).eval()
    bounded.load_state_dict(shrunk.state_dict())
    seq = _sequences(19, b=3, t=12)
    win = prefix_window(seq, 11)._replace(error=None)
    times = seq.time[:, 10] + 400 * 86400.0  # far past any gap in the window
    with torch.no_grad():
        a = default.readout(win, seq.card[:, 11], seq.deck[:, 11], times)
        b = bounded.readout(win, seq.card[:, 11], seq.deck[:, 11], times)
        c = shrunk.readout(win, seq.card[:, 11], seq.deck[:, 11], times)
    torch.testing.assert_close(a.recall, b.recall, atol=0, rtol=0)
    assert not torch.allclose(a.recall, c.recall)


def test_gap_shrink_keeps_stepping_equal_to_the_full_pass(shrunk):
    seq = _sequences(23)
    params = _user_params()
    full = shrunk(seq, params)
    state = (*shrunk.init_state(B)[:9], params)
    for i in range(T):
        out = shrunk.readout(state, seq.card[:, i], seq.deck[:, i], seq.time[:, i])
        torch.testing.assert_close(out.rating_probs, full.rating_probs[:, i], atol=1e-5, rtol=0)
        state = shrunk.step(state, *(field[:, i] for field in seq[:6]))


# ---- the mixture with FSRS-6's default parameters, weighted by each user's evidence --------------------------------


@pytest.fixture(scope="module")
def mixed(model):
    """`model` with the mixture on: a new user's evidence 2 nats, halving every 5 scored reviews (short, so that these
    short sequences move it), and calibration that is not the identity."""
    m = TimeAwareTransformer(TimeAwareConfig(**{**model.cfg.to_dict(), "evidence_prior": 2.0,
                                                "evidence_halflife": 5.0}))
    m.load_state_dict(model.state_dict())
    with torch.no_grad():
        m.calibration.copy_(torch.tensor([1.2, 0.1]))
    return m.eval()


def test_stepping_equals_the_full_pass_with_the_evidence_mixture(mixed):
    """The evidence a step records is the decayed sum of FSRS-6's defaults' log loss minus the network's on the scored
    reviews so far, from the prior; every answer, stepped or in the full pass, mixes the two with it."""
    seq = _sequences(29)
    params = _user_params()
    full = mixed(seq, params)
    state = (*mixed.init_state(B)[:9], params, *mixed.init_state(B)[10:])
    torch.testing.assert_close(state[11], torch.full((B,), 2.0))
    a, evidence, moved = 0.5 ** (1 / 5.0), torch.full((B,), 2.0, dtype=torch.float64), 0
    for i in range(T):
        out = mixed.readout(state, seq.card[:, i], seq.deck[:, i], seq.time[:, i])
        torch.testing.assert_close(out.rating_probs, full.rating_probs[:, i], atol=1e-5, rtol=0)
        torch.testing.assert_close(out.network_recall, full.network_recall[:, i], atol=1e-5, rtol=0)
        y = (seq.rating[:, i] > 1).double()

        def loss(p, y=y):
            p = p.double().clamp(1e-6, 1 - 1e-6)
            return -(y * p.log() + (1 - y) * (-p).log1p())

        evidence = torch.where(out.scored, a * evidence + loss(out.default_recall) - loss(out.network_recall),
                               evidence)
        moved += int(out.scored.sum())
        state = mixed.step(state, *(field[:, i] for field in seq[:6]))
        torch.testing.assert_close(state[11].double(), evidence, atol=1e-4, rtol=0)
    assert moved > 5 and float((evidence.detach() - 2.0 * a ** 20).abs().max()) > 0.1  # the evidence did move


def test_the_mixture_is_the_network_or_fsrs6s_defaults_as_the_evidence_says(mixed):
    """Much evidence for the network: its own answer; much against: FSRS-6's with the default parameters (the same as
    FSRS-6's own recall for a user whose parameters are the defaults); none: the mean of the two probabilities."""
    seq = _sequences(31)
    params = _user_params()
    window = prefix_window(seq, T - 1)
    card, deck, later = seq.card[:, -1], seq.deck[:, -1], seq.time[:, -1] + 6 * 86400

    def at(evidence, user=params):
        return mixed.readout((*window, torch.zeros(B, 2), user, torch.full((B,), 4 * 3600.0),
                              torch.full((B,), evidence)), card, deck, later)

    net, defaults, even = at(40.0), at(-40.0), at(0.0)
    seen = net.scored
    assert int(seen.sum()) >= 2
    torch.testing.assert_close(net.recall, net.network_recall, atol=1e-6, rtol=0)
    torch.testing.assert_close(defaults.recall[seen], defaults.default_recall[seen], atol=1e-6, rtol=0)
    torch.testing.assert_close(even.recall[seen], (even.network_recall + even.default_recall)[seen] / 2, atol=1e-6,
                               rtol=0)
    as_default = at(-40.0, mixed.fsrs_w.float().expand(B, -1))
    torch.testing.assert_close(defaults.default_recall, as_default.fsrs_recall, atol=1e-6, rtol=0)
    # the rating probabilities move with P(recall): still a distribution, P(Again) = 1 - P(recall)
    torch.testing.assert_close(defaults.rating_probs.sum(-1), torch.ones(B), atol=1e-6, rtol=0)
    torch.testing.assert_close(defaults.rating_probs[:, 0], 1 - defaults.recall, atol=1e-6, rtol=0)


def test_the_mixed_curve_never_rises_and_schedule_is_its_inverse(mixed):
    seq = _sequences(37, n_cards=3)
    state = (*prefix_window(seq, T), torch.tensor([[0.5, 2.0]] * B), _user_params(), torch.full((B,), 4 * 3600.0),
             torch.tensor([-1.0, 0.3, 1.5]))
    offsets = torch.from_numpy(np.sort(np.exp(np.random.default_rng(1).uniform(np.log(60), np.log(3.2e8), 300))))
    with torch.no_grad():
        for b in range(B):
            one = tuple(x[b:b + 1].expand(len(offsets), *x.shape[1:]) for x in state)
            for card in range(3):
                q = torch.full((len(offsets),), card)
                recall = mixed.readout(one, q, q % 2, seq.time[b, -1] + offsets).recall
                assert float(torch.diff(recall).max()) <= 1e-6, (b, card)
        card, deck, now = seq.card[:, 1], seq.deck[:, 1], seq.time[:, -1] + 3600
        for retention in (0.95, 0.8, 0.6):
            recall, log_wait, _ = mixed.schedule(state, card, deck, now, torch.full((B,), retention))
            wait = torch.expm1(log_wait) * 86400
            torch.testing.assert_close(mixed.readout(state, card, deck, now + wait).recall, recall, atol=1e-6, rtol=0)
            later = wait > 0  # the curve counts FSRS's whole days, so it may step past the retention: the due is
            assert bool(later.any())  # where it falls to it, at or below it there, above it a second before
            assert bool((recall[later] <= retention + 1e-6).all())
            before = mixed.readout(state, card, deck, now + wait - 1.0).recall
            assert bool((before[later] > retention - 1e-6).all())


def test_no_future_leak_through_the_evidence(mixed):
    seq = _sequences(41)
    base = mixed(seq)
    for t in range(1, T):
        changed = [x.clone() for x in seq[:7]]
        changed[3][:, t:] = 5 - changed[3][:, t:]  # every later rating flipped
        out = mixed(Window(*changed))
        torch.testing.assert_close(out.rating_probs[:, :t + 1], base.rating_probs[:, :t + 1], atol=0, rtol=0)
