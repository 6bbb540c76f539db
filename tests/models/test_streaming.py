"""Every model family of the registry implements the one streaming contract (nextstep/models/streaming.py)."""

import pytest
import torch

from nextstep.models.streaming import StreamingModel
from nextstep.service.registry import tasks
from nextstep.training.families import FAMILIES


@pytest.mark.parametrize("entry", list(FAMILIES.values()), ids=lambda e: e.name)
def test_family_implements_the_contract(entry):
    assert entry.sample is not None, f"{entry.name}: its registry entry names no sample model"
    model = entry.sample_model()
    assert isinstance(model, StreamingModel)
    assert (model.family, model.task) == (entry.name, entry.task)  # the names artifacts and the routes go by
    assert model.task in tasks()  # (a task the service answers: the one list, service/__init__.py's)
    spec = model.state_spec()
    state = model.init_state(3)
    assert [s["name"] for s in spec] == [s["name"] for s in spec if s["name"]]  # named
    assert len({s["name"] for s in spec}) == len(spec) == len(state)
    for s, tensor in zip(spec, state, strict=True):
        assert list(tensor.shape) == [3, *s["shape"]], s["name"]
        assert tensor.dtype == getattr(torch, s["dtype"]), s["name"]
