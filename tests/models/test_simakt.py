import json
import math

import numpy as np
import pytest
import torch

from nextstep.models.layers.decay_attention import DecayAttention, KnowledgeReadout, causal
from nextstep.models.layers.similarity import (
    REGISTRY,
    BankHead,
    ClusterHead,
    _farthest_first,
    kmeans,
    position_weighted,
)
from nextstep.models.simakt import ConfigError, SimAKT, SimAKTConfig, parse_similarity, rule_chunks

DUAL = {"intra_heads": 2, "inter_heads": [{"type": "cluster", "size": 10, "temperature": 0.5},
                                          {"type": "knn", "size": 12, "k_neighbors": 4, "temperature": 1.0}]}
PEERS = {**DUAL, "answer_heads": [{"type": "peers", "size": 6, "d_key": 8}]}  # block 3's heads and an answer head


def make(similarity=None, window=16, seed=0, problems=True, **cfg) -> SimAKT:
    torch.manual_seed(seed)
    cfg = SimAKTConfig(n_questions=30, n_skills=12, n_problems=20 if problems else 0, d_model=32, n_heads=4, n_know=4,
                       window=window, dropout=0.0, similarity=similarity if similarity is not None else DUAL, **cfg)
    m = SimAKT(cfg).eval()
    m.question_skill.copy_(torch.randint(2, 12, (30,)))
    m.question_problem.copy_(torch.randint(2, 20, (30,)))
    with torch.no_grad():
        if problems:
            m.problem_diff.weight.normal_()  # trained difficulties are not zero
    return m


def banks(window=16, d=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(10, window, d, generator=g), torch.randint(1, window + 1, (10,), generator=g)),
            (torch.randn(12, window, d, generator=g), torch.randint(1, window + 1, (12,), generator=g))]


def peer_banks(m: SimAKT, window=16, seed=3, n=24, mix=True) -> list[tuple[torch.Tensor, ...]]:
    """Block 3's random banks and the answer heads' banks built from n random trajectories by the model itself;
    with `mix`, each answer head's output weights drawn at random (trained ones are not zero)."""
    from nextstep.training.kt.banks import Bank, encode_readouts, select_answer_banks

    rng = np.random.default_rng(seed)
    trajs = [(rng.integers(2, 30, window), rng.integers(0, 2, window)) for _ in range(n)]
    raw = banks(window=window)[:len(m.heads)]
    block3 = [Bank("", "", s.numpy(), l.numpy(), None, None, []) for s, l in raw]
    answer = select_answer_banks(m, encode_readouts(m, trajs, block3), [str(i) for i in range(n)], seed)
    if mix:
        with torch.no_grad():
            for head in m.answerers:
                head.mix.weight.normal_()
                head.mix.bias.normal_()
    return raw + [b.tensors() for b in answer]


def data(B=3, T=14, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 30, (B, T), generator=g), torch.randint(0, 2, (B, T), generator=g)


def walk(m: SimAKT, kv, q, r, state=None):
    """Readout before each interaction, then step: logits (B, T) and the final state."""
    state = m.init_state(q.shape[0]) if state is None else state
    out = []
    for t in range(q.shape[1]):
        out.append(m.readout(state, q[:, t:t + 1], kv).logits[:, 0])
        state = m.step(state, q[:, t], r[:, t], kv)
    return torch.stack(out, 1), state


@pytest.mark.parametrize("similarity", [DUAL, PEERS], ids=["dual", "peers"])
@pytest.mark.parametrize("problems", [True, False])
@pytest.mark.parametrize("caches", [1, 2, 4])
def test_stepping_equals_the_full_pass_under_the_window_rule(problems, caches, similarity):
    """Past several windows: each prediction is the full pass over the chunk the rule names (float32 cache)."""
    W = 8
    m = make(similarity, window=W, problems=problems, caches=caches, cache_dtype="float32")
    kv = m.bank_keys(peer_banks(m, window=W))
    q, r = data(T=5 * W + 3)
    with torch.no_grad():
        full = m.chunked(q, r, kv)
        assert torch.equal(full[:, :W], m(q[:, :W], r[:, :W], kv).logits)  # the first chunk is the plain full pass
        stepped, _ = walk(m, kv, q, r)
    assert (stepped - full).abs().max() <= 1e-5


def test_float16_cache_stays_near_the_full_pass():
    W = 16
    m = make(window=W)
    assert m.cfg.cache_dtype == "float16" and m.state_spec()[3]["dtype"] == "float16"
    kv = m.bank_keys(banks(window=W))
    q, r = data(T=3 * W)
    with torch.no_grad():
        stepped, state = walk(m, kv, q, r)
        gap = (torch.sigmoid(stepped) - torch.sigmoid(m.chunked(q, r, kv))).abs().max()
    assert state[3].dtype == torch.float16 and 0 < gap <= 1e-3  # rounded, and close


@pytest.mark.parametrize("caches", [1, 2, 4])
def test_rule_chunks_score_every_interaction_once_from_the_chunk_readout_uses(caches):
    W = 12
    m = make(window=W, caches=caches)
    for length in (1, W - 1, W, W + 1, 3 * W + 5):
        scored = [n for start, first in rule_chunks(length, W, caches) for n in range(start + first, start + W)
                  if n < length]
        assert scored == list(range(length))
        cache, at = m._predicting(torch.arange(length))
        start = torch.arange(length) - at
        for n in range(length):
            chunk = next((s, f) for s, f in rule_chunks(length, W, caches) if s + f <= n < s + W)
            assert start[n] == chunk[0] and m._positions(torch.tensor([n]))[0, cache[n]] == at[n]
        least = W - W // caches  # once a learner has that much history, every prediction sees at least that
        assert all(a >= least for a in at[least:].tolist()) and at.max() <= W - 1


def test_rebase_reaches_the_stepped_state_with_either_bank():
    """rebase encodes each cache's chunk afresh: its predictions, explanations and later steps are the stepped
    state's; with another bank they are that bank's (what stepping with it from the start gives)."""
    W = 8
    m = make(window=W, cache_dtype="float32")
    kv, other = m.bank_keys(banks(window=W)), m.bank_keys(banks(window=W, seed=5))
    q, r = data(T=3 * W + 3)
    n = 2 * W + 1
    with torch.no_grad():
        _, state = walk(m, kv, q[:, :n], r[:, :n])
        for bank in (kv, other):
            want, _ = walk(m, bank, q, r)
            _, stepped = walk(m, bank, q[:, :n], r[:, :n])
            rebased = m.rebase(state[0], state[1], state[2], bank)
            a, b = m.readout(stepped, q[:, n:n + 2], bank), m.readout(rebased, q[:, n:n + 2], bank)
            assert torch.allclose(a.logits, b.logits, atol=1e-5)
            assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(a.inter_weights, b.inter_weights, strict=True))
            later, _ = walk(m, bank, q[:, n:], r[:, n:], rebased)
            assert (later - want[:, n:]).abs().max() <= 1e-5
        assert not torch.allclose(walk(m, kv, q, r)[0], walk(m, other, q, r)[0], atol=1e-4)  # the banks differ


@pytest.mark.parametrize("similarity", [DUAL, PEERS], ids=["dual", "peers"])
def test_no_future_leak(similarity):
    """Nothing after t (question or response), nor the response at t, moves the prediction at t.
    (2e-6 on logits near 1.5, not bit-identical: block 4's scan rescales by a running maximum that later keys can
    raise, a few float32 roundings; 1.07e-6 was seen under load. A leak moves them by more than 1e-3, below.)"""
    m = make(similarity)
    kv = m.bank_keys(peer_banks(m))
    q, r = data(T=30)
    with torch.no_grad():
        base = m(q, r, kv).logits
        for t in (0, 7, 29):
            q2, r2 = q.clone(), r.clone()
            q2[:, t + 1:] = 3
            r2[:, t:] = 1 - r2[:, t:]
            other = m(q2, r2, kv).logits
            assert (other[:, :t + 1] - base[:, :t + 1]).abs().max() <= 2e-6
            if t < 29:
                assert (other[:, t + 1:] - base[:, t + 1:]).abs().max() > 1e-3  # the test can fail


def test_students_in_a_batch_do_not_see_each_other():
    m = make()
    kv = m.bank_keys(banks())
    q, r = data()
    with torch.no_grad():
        base = m(q, r, kv).logits
        r2 = r.clone()
        r2[1] = 1 - r2[1]
        other = m(q, r2, kv).logits
    assert torch.equal(other[0], base[0]) and torch.equal(other[2], base[2])


def _copy(src: SimAKT, similarity) -> SimAKT:
    dst = make(similarity)
    dst.load_state_dict(src.state_dict(), strict=False)  # the baseline has no bank projections
    return dst


def test_inter_heads_off_or_at_zero_influence_is_the_baseline_exactly():
    trained = make(DUAL)
    q, r = data(T=20)
    baseline = _copy(trained, {})  # every head intra-student: DTransformer
    off = {**DUAL, "inter_heads": [{**h, "enabled": False} for h in DUAL["inter_heads"]]}
    zero = {**DUAL, "inter_heads": [{**h, "influence_weight": 0} for h in DUAL["inter_heads"]]}
    with torch.no_grad():
        expected = baseline(q, r).logits
        for cfg in (off, zero):
            model = _copy(trained, cfg)
            assert model.heads == []
            assert torch.equal(model(q, r).logits, expected)
            state = model.init_state(3)
            for t in range(5):
                state = model.step(state, q[:, t], r[:, t])
            assert torch.equal(model.readout(state, q[:, 5:6]).logits, baseline.readout(state, q[:, 5:6]).logits)
        # and a head that is on does change the output
        assert not torch.allclose(trained(q, r, trained.bank_keys(banks())).logits, expected, atol=1e-4)


def test_an_answer_head_starts_as_the_baseline_exactly_and_then_reads_its_bank():
    with_peers = make(PEERS)
    baseline = _copy(with_peers, DUAL)
    q, r = data(T=20)
    kv = with_peers.bank_keys(peer_banks(with_peers, mix=False))
    with torch.no_grad():
        assert torch.equal(with_peers(q, r, kv).logits, baseline(q, r, kv[:2]).logits)
        with_peers.answerers[0].mix.weight.fill_(1.0)
        assert not torch.allclose(with_peers(q, r, kv).logits, baseline(q, r, kv[:2]).logits, atol=1e-3)
        off = _copy(with_peers, {**PEERS, "answer_heads": [{**PEERS["answer_heads"][0], "enabled": False}]})
        assert off.answerers == [] and torch.equal(off(q, r, kv[:2]).logits, baseline(q, r, kv[:2]).logits)


def test_peer_banks_keep_each_questions_peers_from_the_chosen_students_only():
    from nextstep.training.kt.banks import encode_readouts, select_answer_banks

    m = make({"intra_heads": 4, "answer_heads": [{"type": "peers", "size": 5, "d_key": 8}]})
    rng = np.random.default_rng(0)
    # students 0-9 answer rows 2..15 only, students 10-19 rows 16..29 only
    trajs = [(rng.integers(2, 16, 12) if i < 10 else rng.integers(16, 30, 12), rng.integers(0, 2, 12))
             for i in range(20)]
    readouts = encode_readouts(m, trajs)
    whole = select_answer_banks(m, readouts, [f"s{i}" for i in range(20)])[0]
    half = select_answer_banks(m, readouts, [f"s{i}" for i in range(20)], rows=list(range(10)))[0]
    seen = np.bincount(np.concatenate([t[0] for t in trajs]), minlength=30)
    assert np.array_equal(whole.parts["count"], np.minimum(seen, 5))
    assert (half.parts["count"][16:] == 0).all() and (half.parts["count"][2:16] == np.minimum(seen[2:16], 5)).all()
    assert half.students == [f"s{i}" for i in range(10)]
    first, count, responses = whole.parts["first"], whole.parts["count"], whole.parts["responses"]
    assert np.array_equal(first, np.cumsum(count) - count) and len(responses) == count.sum()
    for row in (2, 17):  # a row's kept responses are some of that row's answers
        answers = np.concatenate([t[1][t[0] == row] for t in trajs])
        kept = responses[first[row]:first[row] + count[row]]
        assert kept.sum() <= answers.sum() and (count[row] - kept.sum()) <= (answers == 0).sum()
    assert np.allclose(np.linalg.norm(whole.parts["keys"], axis=1), 1.0, atol=1e-5)
    assert len(whole.parts["expected"]) == len(responses) and ((whole.parts["expected"] > 0)
                                                               & (whole.parts["expected"] < 1)).all()
    assert np.isclose(whole.parts["mean"][0], responses.mean())


def test_the_peer_head_follows_the_most_alike_peer_at_a_low_temperature():
    from nextstep.models.layers.similarity import PeerAnswers

    spec = parse_similarity({"intra_heads": 4, "answer_heads": [{"type": "peers", "size": 4, "d_key": 2,
                                                                  "temperature": 0.01}]}, 4).answer_heads[0]
    head = PeerAnswers(2, spec)
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    responses = torch.tensor([1.0, 0.0, 0.0])  # row 1: a right answer by one peer, wrong by two others
    expected = torch.tensor([0.5, 0.2, 0.2])  # what the model expected of each
    first, count, m = torch.tensor([0, 0, 3]), torch.tensor([0, 3, 0]), torch.tensor([0.4])
    logit = lambda p: torch.log(p / (1 - p))  # noqa: E731
    smoothed = lambda p: logit((p * 3 + 2 * m) / 5) - logit(m)  # noqa: E731

    def term(weights, h, row=1):
        with torch.no_grad():
            head.query_map.copy_(torch.eye(2))
            head.mix.weight.copy_(torch.tensor([weights]))
            return head(torch.tensor([[h]]), torch.tensor([[row]]), keys, responses, expected, first, count, m)

    near_right, near_wrong = [2.0, 0.1], [0.1, 2.0]
    assert torch.allclose(term([1.0, 0, 0, 0, 0], near_right), smoothed(torch.tensor(1.0)), atol=1e-4)
    assert torch.allclose(term([1.0, 0, 0, 0, 0], near_wrong), smoothed(torch.tensor(0.0)), atol=1e-4)
    assert torch.allclose(term([0, 1.0, 0, 0, 0], near_right), smoothed(torch.tensor(0.5)), atol=1e-4)
    assert torch.allclose(term([0, 0, 1.0, 0, 0], near_wrong), smoothed(torch.tensor(1 / 3)), atol=1e-4)
    assert torch.allclose(term([0, 0, 0, 1.0, 0], near_wrong), smoothed(torch.tensor(0.3)), atol=1e-4)
    assert torch.allclose(term([0, 0, 0, 0, 1.0], near_wrong), torch.log1p(torch.tensor(3.0)), atol=1e-4)
    assert term([1.0] * 5, near_right, row=2).item() == 0.0  # no peers: the bias alone (0 here)


def test_influence_weight_scales_the_head_output():
    weighted = make({"intra_heads": 3, "inter_heads": [{"type": "cluster", "size": 10, "influence_weight": 2.5}]})
    unit = _copy(weighted, {"intra_heads": 3, "inter_heads": [{"type": "cluster", "size": 10}]})
    kv = weighted.bank_keys(banks()[:1])
    hq, hs = torch.randn(2, 9, 32), torch.randn(2, 9, 32)
    with torch.no_grad():
        a, wa = weighted.block3.heads(hq, hs, kv)
        b, wb = unit.block3.heads(hq, hs, kv)
    assert torch.allclose(a[:, 3], 2.5 * b[:, 3]) and torch.equal(a[:, :3], b[:, :3])
    assert torch.equal(wa[0], wb[0])


# ----------------------------------------------------------------------------- position weighting and heads

def test_position_weighted_keys_match_the_seeds_formula():
    g = torch.Generator().manual_seed(0)
    M, L, e = 3, 9, 4
    x, lengths = torch.randn(M, L, e, generator=g), torch.tensor([9, 4, 1])
    decay, fw = 0.8, 0.3
    got = position_weighted(x, lengths, decay, fw)  # (L, M, e)
    for m in range(M):
        for t in range(L):
            w = [decay ** (t - i) if i <= t else fw * decay ** (i - t - 1) for i in range(int(lengths[m]))]
            ref = sum(wi * x[m, i] for i, wi in enumerate(w)) / sum(w)
            assert torch.allclose(got[t, m], ref, atol=1e-5)


def test_future_weight_zero_compares_entries_up_to_the_position_only():
    x = torch.randn(2, 10, 3)
    a = position_weighted(x, torch.tensor([10, 10]), 0.9, 0.0)
    x2 = x.clone()
    x2[:, 6:] = 100.0
    b = position_weighted(x2, torch.tensor([10, 10]), 0.9, 0.0)
    assert torch.allclose(a[:6], b[:6]) and not torch.allclose(a[6:], b[6:])


def test_knn_weights_keep_k_neighbours_and_cluster_weights_all():
    m = make()
    q = torch.randn(2, 5, 8)
    cluster, knn = m.block3.inter["cluster"], m.block3.inter["knn"]
    keys = torch.randn(5, 12, 8)
    w = knn.weights(q, keys)
    assert ((w > 0).sum(-1) == 4).all() and torch.allclose(w.sum(-1), torch.ones(2, 5))
    nearest = ((q[:, :, None] - keys[None]) ** 2).sum(-1).topk(4, largest=False).indices
    assert torch.equal(torch.sort(w.topk(4).indices, -1).values, torch.sort(nearest, -1).values)
    w = cluster.weights(q, keys[:, :10])
    assert (w > 0).all() and torch.allclose(w.sum(-1), torch.ones(2, 5))
    # the fewest entries each head's graphs take (the export's bank dimension): k for the KNN head
    assert (cluster.min_entries, knn.min_entries) == (2, 4)


def test_kmeans_finds_separated_clusters_and_farthest_first_spreads():
    rng = np.random.default_rng(0)
    centres = np.array([[0, 0], [10, 0], [0, 10]], dtype=float)
    x = np.concatenate([c + rng.normal(0, 0.3, (30, 2)) for c in centres])
    labels = kmeans(x, 3, seed=0)
    assert sorted(np.bincount(labels).tolist()) == [30, 30, 30]
    assert all(len(set(labels[i * 30:(i + 1) * 30])) == 1 for i in range(3))
    chosen = _farthest_first(x, 3, seed=0)
    assert len({int(c) // 30 for c in chosen}) == 3  # one from each blob


def test_knowledge_readout_scan_equals_a_direct_computation():
    torch.manual_seed(0)
    block = KnowledgeReadout(16, 4, 3, 0.0).eval()
    with torch.no_grad():
        block.rate.copy_(torch.tensor([0.0, 0.5, 1.5, 2.0]))
    hq, p = torch.randn(2, 70, 16) * 3, torch.randn(2, 70, 16)
    with torch.no_grad():
        z = block(hq, p)
        mix, top = torch.zeros(2, 3, 4, 5), torch.full((2, 3, 4), block.EMPTY)
        for t in range(70):  # the running state, one row at a time, and at once from the whole sequence
            at = block.finish(block.running(hq, p, torch.tensor([t, t]))[0])
            assert torch.allclose(z[:, t], at[:, 0], atol=1e-5)
            assert torch.allclose(z[:, t], block.finish(mix)[:, 0], atol=1e-5)
            mix, top = block.add(mix, top, hq[:, t], p[:, t], torch.tensor([t, t]))
        # direct: softmax over j < t of s_j - g (t - j), per head
        H, dh = 4, 4
        qk = block.qk(block.know).view(3, H, dh)
        k = block.qk(hq).view(2, 70, H, dh)
        v = block.v(p).view(2, 70, H, dh)
        t = 40
        s = torch.einsum("khd,bjhd->bkhj", qk, k[:, :t]) / math.sqrt(dh) - block.rate[:, None] * (t - torch.arange(t))
        mixed = torch.einsum("bkhj,bjhd->bkhd", torch.softmax(s, -1), v[:, :t])
        ref = block.norm(block.know + block.out(mixed.reshape(2, 3, 16)))
        assert torch.allclose(z[:, t], ref, atol=1e-5)


def test_decay_distances_keep_float32_accuracy_when_later_keys_carry_little_attention():
    """AKT's distance is sqrt(gap * attention after j); as the total minus a running sum it cancels to noise
    when the keys after j carry little attention, and sqrt and a large gamma blow that noise up: engines
    then disagree well past 1e-4 (an export once failed so). Summed backwards, float32 stays close to float64."""
    torch.manual_seed(0)
    attn = DecayAttention(16, 2)
    with torch.no_grad():
        attn.gamma.copy_(torch.tensor([30.0, 60.0]).view(2, 1, 1))
    T = 120
    scores = torch.randn(3, 2, T, T, dtype=torch.float64) * 6
    scores[..., :, ::7] += 12  # a few keys take most of the attention, the keys after them little
    mask, gap = causal(T, True)
    with torch.no_grad():
        exact = attn.double().weights(scores, mask, gap)
        single = attn.float().weights(scores.float(), mask, gap)
    assert (single.double() - exact).abs().max() < 1e-5


# ----------------------------------------------------------------------------- configuration

def test_both_configuration_styles_build_the_same_heads():
    dual = parse_similarity({"approach": "position_weighted_dual", "cluster_config": {"n_clusters": 50},
                             "knn_config": {"memory_size": 100, "k_neighbors": 10},
                             "temporal_config": {"future_weight": 0.0}}, 8)
    modular = parse_similarity({"intra_heads": 6, "inter_heads": [
        {"type": "cluster", "n_clusters": 50, "temperature": 0.05, "temporal_config": {"future_weight": 0.0}},
        {"type": "knn", "memory_size": 100, "k_neighbors": 10, "temporal_config": {"future_weight": 0.0}}]}, 8)
    assert dual == modular
    assert [h.size for h in dual.inter_heads] == [50, 100] and dual.intra_heads == 6
    assert parse_similarity({"approach": "none"}, 8).inter_heads == []
    assert parse_similarity({"similarity_config": {"approach": "knn"}}, 8).intra_heads == 7


@pytest.mark.parametrize("config, where", [
    ({"intra_heads": 7, "inter_heads": [{"type": "cluster"}, {"type": "knn"}]}, "intra_heads"),
    ({"approach": "position_weighted_dual", "intra_heads": 7}, "intra_heads"),
    ({"approach": "position_weighted_dual", "inter_heads": 3}, "inter_heads"),
    ({"approach": "knn", "total_heads": 4}, "total_heads"),
    ({"intra_heads": 7, "inter_heads": [{"type": "cluster", "influence_weight": -1}]},
     "inter_heads[0].influence_weight"),
    ({"approach": "knn", "knn_config": {"influence_weight": -0.5}}, "knn_config.influence_weight"),
    ({"intra_heads": 7, "inter_heads": [{"type": "graph"}]}, "inter_heads[0].type"),
    ({"intra_heads": 7, "inter_heads": [{"type": "knn", "k_neighbor": 3}]}, "inter_heads[0].k_neighbor"),
    ({"intra_heads": 7, "inter_heads": [{"type": "knn", "memory_size": 5, "k_neighbors": 6}]},
     "inter_heads[0].k_neighbors"),
    ({"intra_heads": 7, "inter_heads": [{"type": "cluster", "temporal_config": {"future_weight": 1.5}}]},
     "inter_heads[0].temporal_config.future_weight"),
    ({"intra_heads": 6, "inter_heads": [{"type": "cluster"}, {"type": "cluster"}]}, "inter_heads[1].name"),
    ({"approach": "hybrid"}, "approach"),
    ({"approach": "knn", "colour": "red"}, "colour"),
    ({"intra_heads": 8, "answer_heads": [{"type": "cluster"}]}, "answer_heads[0].type"),
    ({"intra_heads": 8, "answer_heads": [{"type": "peers", "size": 0}]}, "answer_heads[0].size"),
    ({"intra_heads": 8, "answer_heads": [{"type": "peers", "k": 3}]}, "answer_heads[0].k"),
    ({"intra_heads": 8, "answer_heads": {"type": "peers"}}, "answer_heads"),
    ({"intra_heads": 7, "inter_heads": [{"type": "knn", "name": "peers"}], "answer_heads": [{"type": "peers"}]},
     "answer_heads[0].name"),
])
def test_bad_configurations_name_the_key(config, where):
    with pytest.raises(ConfigError) as err:
        parse_similarity(config, 8)
    assert err.value.where == where


def test_the_repository_configurations_parse(tmp_path):
    from pathlib import Path

    from nextstep.training.kt.simakt_run import load_similarity

    root = Path(__file__).resolve().parents[2] / "configs" / "simakt"
    got = {p.stem: parse_similarity(load_similarity(p), 8) for p in sorted(root.iterdir())}
    assert [len(got[n].active) for n in ("none", "cluster", "knn", "dual")] == [0, 1, 1, 2]
    assert [h.type for h in got["peers"].answering] == ["peers"] and got["peers"].active == []
    collection = tmp_path / "many.json"
    collection.write_text(json.dumps({"similarity_approaches": {"strict_causal": {"approach": "knn"}}}))
    assert parse_similarity(load_similarity(f"{collection}#strict_causal"), 8).inter_heads[0].type == "knn"


class MeanHead(BankHead):
    """A plug-in for the test: one bank entry per five trajectories, uniform weights."""

    @classmethod
    def select(cls, summaries, spec, seed):
        return [np.arange(i, min(i + 5, len(summaries))) for i in range(0, len(summaries), 5)]

    def weights(self, q, keys):
        return torch.full((q.shape[0], q.shape[1], keys.shape[1]), 1.0 / keys.shape[1])


def test_a_new_similarity_module_plugs_in_by_path():
    sim = {"intra_heads": 3, "inter_heads": [{"type": f"{__name__}:MeanHead", "size": 4}]}
    m = make(sim)
    assert isinstance(m.heads[0], MeanHead) and "cluster" in REGISTRY and REGISTRY["cluster"] is ClusterHead
    q, r = data()
    with torch.no_grad():
        out = m(q, r, m.bank_keys(banks()[:1])).logits
    assert out.shape == q.shape and torch.isfinite(out).all()
    with pytest.raises(ConfigError, match="not a BankHead"):
        parse_similarity({"intra_heads": 3, "inter_heads": [{"type": "torch.nn:Linear"}]}, 4)


def test_contrastive_views_swap_neighbours_and_flip_responses_inside_the_sequence():
    from nextstep.models.simakt import _augment

    q, r = data(B=4, T=30)
    mask = torch.arange(30)[None, :] < torch.tensor([[30], [12], [2], [1]])
    (q2, r2), flipped = _augment(q, r, mask, 0.3, torch.Generator().manual_seed(0))
    for b in range(4):
        n = int(mask[b].sum())
        pairs = sorted(zip(q[b, :n].tolist(), r[b, :n].tolist(), strict=True))
        assert sorted(zip(q2[b, :n].tolist(), r2[b, :n].tolist(), strict=True)) == pairs  # same steps
        assert torch.equal(q2[b, n:], q[b, n:]) and torch.equal(flipped[b, n:], r[b, n:])  # padding untouched
    assert (q2 != q).any() and (flipped != r).any()


def test_contrastive_loss_trains():
    from nextstep.models.simakt import contrastive_loss

    m = make().train()
    kv = m.bank_keys(banks())
    q, r = data(B=4, T=20)
    mask = torch.arange(20)[None, :] < torch.tensor([[20], [15], [20], [9]])
    out = m(q, r, kv)
    loss = contrastive_loss(m, q, r, mask, kv, out.knowledge, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(loss) and loss > 0
    loss.backward()
    assert m.block4.know.grad is not None and m.block4.know.grad.abs().sum() > 0
