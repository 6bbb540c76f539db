"""The streaming contract: the one interface every model family implements.

An entity (a learner, a shopping session, a flashcard user) is a state folded over its events. Training,
export and serving know a family only through these five members:

    state_spec() -> [StateTensor]        names, per-entity shapes, dtypes and initial values of the state
    init_state(B) -> state               B new entities: a tuple of tensors in state_spec order, batch axis first
    step(state, *event) -> state         fold one observed event in; each event tensor is (B,)
    readout(state, *query) -> outputs    answer a query without changing the state
    forward(*sequence) -> outputs        the teacher-forced full pass used in training: its output at t is what
                                         readout gives after stepping through the events before t

plus two class attributes, `family` (the name artifacts and the CLI use) and `task` (which service routes answer
it), and optionally `for_serving() -> StreamingModel`: a form of the same model whose step and readout are cheaper
to run (deep_gpcm's Bayes filter looks its item side up in tables), which the export harness exports in its place and
checks against this model's `forward`. Each family is one file under nextstep/models/ with a dataclass config;
deep_gpcm.py is the example.

    task               families                          event               query                 readout
    knowledge_tracing  deep_gpcm, attention_gpcm,        question, response  questions (B, M)      log_probs (B, M, K);
                       coral_gpcm, dkt, simakt (+ banks)                                           + GPCM: theta, alpha,
                                                                                                   beta
    next_item          gru4rec, mrn, popularity, markov  item                exclude (B, S), k     top-k rows and scores
    srs                time_aware                        a review's fields   card, deck, time (B,) rating probs, recall,
                                                                                                   log duration

The tests hold every family to the contract: stepping equals the full pass (<= 1e-5), no output at t depends on
anything at or after t, and the exported graphs of step and readout agree with the eager model (<= 1e-4).
"""

from typing import Protocol, TypedDict, runtime_checkable

import torch

State = tuple[torch.Tensor, ...]


class StateTensor(TypedDict, total=False):
    """One per-entity state tensor, as the artifact's manifest lists it."""

    name: str
    shape: list[int]  # per entity, without the batch axis
    dtype: str  # numpy dtype name: "float32", "int64", ...
    init: str  # how init_state makes it: "zeros", "learned ..."
    file: str  # set at export: the .npy holding one entity's initial value


@runtime_checkable
class StreamingModel(Protocol):
    family: str
    task: str

    def state_spec(self) -> list[StateTensor]: ...

    def init_state(self, batch: int) -> State: ...

    def step(self, state: State, *event: torch.Tensor) -> State: ...

    def readout(self, state: State, *query): ...

    def forward(self, *sequence): ...


def state_names(model: StreamingModel) -> list[str]:
    return [s["name"] for s in model.state_spec()]
