"""Every model family implements the one streaming contract (nextstep/models/streaming.py)."""

import numpy as np
import pytest
import torch

from nextstep.models.deep_gpcm import MODELS, GPCMConfig
from nextstep.models.dkt import DKT, DKTConfig
from nextstep.models.gru4rec import GRU4Rec, GRU4RecConfig
from nextstep.models.mrn import MRN, MRNConfig
from nextstep.models.next_item import Markov, Popularity
from nextstep.models.simakt import SimAKT, SimAKTConfig
from nextstep.models.streaming import TASKS, StreamingModel
from nextstep.models.time_aware import TimeAwareConfig, TimeAwareTransformer


def _families():
    items = np.array([2, 3, 4, 2, 5, 3])
    yield from (cls(GPCMConfig(n_questions=12, n_cats=3, window=4)) for cls in MODELS.values())
    yield DKT(DKTConfig(n_questions=12, n_cats=3, hidden=8, embed_dim=8, layers=2))
    yield SimAKT(SimAKTConfig(n_questions=12, n_skills=6, d_model=16, n_heads=2, n_know=2, window=8))
    yield GRU4Rec(GRU4RecConfig(n_items=8, layers=(6,)))
    yield MRN(MRNConfig(n_items=8))
    yield Popularity.fit(items, 8)
    yield Markov.fit(items, np.array([0, 3, 6]), 8)
    yield TimeAwareTransformer(TimeAwareConfig(d_model=16, ffn_dim=16, window=8, card_window=2))


@pytest.mark.parametrize("model", list(_families()), ids=lambda m: m.family)
def test_family_implements_the_contract(model):
    assert isinstance(model, StreamingModel)
    assert model.task in TASKS and model.family not in ("", "next_item")
    spec = model.state_spec()
    state = model.init_state(3)
    assert [s["name"] for s in spec] == [s["name"] for s in spec if s["name"]]  # named
    assert len({s["name"] for s in spec}) == len(spec) == len(state)
    for s, tensor in zip(spec, state, strict=True):
        assert list(tensor.shape) == [3, *s["shape"]], s["name"]
        assert tensor.dtype == getattr(torch, s["dtype"]), s["name"]
