"""GRU4Rec (seed 002; Hidasi et al. 2016, and the design of the official implementation).

Items enter as rows of an embedding table; one or more GRU layers carry the session; the scores of
all items are the last hidden state times the output item embeddings Wy plus an item bias By. Wy and
By are stored as one (V, H + 1) table `out` (By its last column), so that a training step updates one
sparse table instead of two.
Three input modes, as in the official code:

* constrained_embedding (default): the input embedding IS the output embedding Wy (shared weights);
* embedding = D > 0: a separate D-dimensional input embedding;
* otherwise one-hot input: a one-hot vector times the first GRU layer's input weights, computed as a
  row lookup in a (V, 3H) table.

Dropout is separate on the input embedding and on the hidden layers; during training the dropped-out
hidden output is also the state carried to the next step (as in the official code). In one-hot mode
the embedding dropout acts on the looked-up gate inputs of the first layer and that layer also gets the
hidden dropout (the official one-hot layer drops its output with the embedding rate instead). All weight
matrices are Glorot-uniform (per gate block for the GRU), biases zero.

Streaming API (shared by every next-item model):
    init_state(B) -> state;  step(state, items (B,)) -> state;  scores(state) -> (B, V)
and forward(items (B, T)) -> scores (B, T, V), where row t has seen items[:, :t+1] only.
Rows 0 (padding) and 1 (unknown item) exist in every table but are never recommended.
"""

from dataclasses import dataclass

import torch
from torch import nn

from .next_item import NextItemModel


@dataclass
class GRU4RecConfig:
    n_items: int  # rows, including padding and unknown
    layers: tuple[int, ...] = (100,)
    embedding: int = 0  # input embedding size; 0 with constrained_embedding False means one-hot input
    constrained_embedding: bool = True
    dropout_embed: float = 0.0
    dropout_hidden: float = 0.4

    def __post_init__(self):
        self.layers = tuple(int(h) for h in self.layers)
        if not self.layers or min(self.layers) < 1:
            raise ValueError(f"layers must be positive sizes, got {self.layers}")
        if self.n_items < 3:
            raise ValueError(f"n_items counts padding and unknown rows, so it must be at least 3, got {self.n_items}")
        for name in ("dropout_embed", "dropout_hidden"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")


def glorot_(t: torch.Tensor, fan_in: int, fan_out: int) -> None:
    bound = (6.0 / (fan_in + fan_out)) ** 0.5
    nn.init.uniform_(t, -bound, bound)


class Dropout(nn.Module):
    """Inverted dropout, the same function as nn.Dropout, with the mask available on its own: the
    training step (training/next_item/gru4rec_step.py) keeps it for the backward pass. The mask comes from one
    uniform draw and a comparison, cheaper than nn.Dropout's Bernoulli sampler for 32 x 100 activations."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def mask(self, x: torch.Tensor) -> torch.Tensor | None:
        """The scaled keep-mask for x (zeros and 1 / (1 - p)); None when nothing is dropped."""
        if not self.training or self.p == 0:
            return None
        return (torch.rand_like(x) >= self.p) * (1.0 / (1.0 - self.p))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.mask(x)
        return x if mask is None else x * mask


class GRULayer(nn.Module):
    """One GRU layer (PyTorch's gate convention) whose input may arrive already projected to 3H gates."""

    def __init__(self, n_in: int, hidden: int, projected_input: bool = False):
        super().__init__()
        self.hidden = hidden
        self.w_hh = nn.Parameter(torch.empty(3 * hidden, hidden))
        self.b_hh = nn.Parameter(torch.zeros(3 * hidden))
        self.w_ih = None if projected_input else nn.Parameter(torch.empty(3 * hidden, n_in))
        self.b_ih = None if projected_input else nn.Parameter(torch.zeros(3 * hidden))
        for g in range(3):
            glorot_(self.w_hh.data[g * hidden:(g + 1) * hidden], hidden, hidden)
            if self.w_ih is not None:
                glorot_(self.w_ih.data[g * hidden:(g + 1) * hidden], n_in, hidden)

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        gi = x if self.w_ih is None else torch.addmm(self.b_ih, x, self.w_ih.t())
        gh = torch.addmm(self.b_hh, h, self.w_hh.t())
        i_r, i_z, i_n = gi.chunk(3, 1)
        h_r, h_z, h_n = gh.chunk(3, 1)
        r = torch.sigmoid(i_r + h_r)
        z = torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        return n + z * (h - n)


class GRU4Rec(NextItemModel):
    family = "gru4rec"

    def __init__(self, cfg: GRU4RecConfig):
        super().__init__()
        self.cfg = cfg
        self.n_items = cfg.n_items
        H = cfg.layers
        self.out = nn.Embedding(cfg.n_items, H[-1] + 1, sparse=True)  # [Wy | By]
        nn.init.zeros_(self.out.weight)
        glorot_(self.out.weight.data[:, :-1], cfg.n_items, H[-1])
        self.one_hot = not cfg.constrained_embedding and cfg.embedding == 0
        if cfg.constrained_embedding:
            self.E, n_in = None, H[-1]
        elif cfg.embedding:
            self.E, n_in = nn.Embedding(cfg.n_items, cfg.embedding, sparse=True), cfg.embedding
            glorot_(self.E.weight.data, cfg.n_items, cfg.embedding)
        else:  # one-hot input: the first layer's input weights are a (V, 3H) lookup table
            self.E, n_in = nn.Embedding(cfg.n_items, 3 * H[0], sparse=True), cfg.n_items
            for g in range(3):
                glorot_(self.E.weight.data[:, g * H[0]:(g + 1) * H[0]], cfg.n_items, H[0])
        self.gru = nn.ModuleList(
            GRULayer(n_in if i == 0 else H[i - 1], H[i], projected_input=self.one_hot and i == 0)
            for i in range(len(H)))
        self.drop_embed = Dropout(cfg.dropout_embed)
        self.drop_hidden = Dropout(cfg.dropout_hidden)

    def state_spec(self) -> list[dict]:
        return [{"name": f"hidden_{i}", "shape": [h], "dtype": "float32"} for i, h in enumerate(self.cfg.layers)]

    def init_state(self, batch: int) -> tuple[torch.Tensor, ...]:
        return tuple(torch.zeros(batch, h) for h in self.cfg.layers)

    def embed(self, items: torch.Tensor) -> torch.Tensor:
        x = self.out(items)[..., :-1] if self.E is None else self.E(items)
        return self.drop_embed(x)

    def advance(self, state: tuple[torch.Tensor, ...], items: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One step of every layer; in training mode with hidden dropout on each layer's output and state."""
        x = self.embed(items)
        out = []
        for layer, h in zip(self.gru, state, strict=True):
            x = self.drop_hidden(layer(x, h))
            out.append(x)
        return tuple(out)

    def step(self, state: tuple[torch.Tensor, ...], items: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.advance(state, items)

    def scores(self, state: tuple[torch.Tensor, ...]) -> torch.Tensor:
        w = self.out.weight
        return torch.addmm(w[:, -1], state[-1], w[:, :-1].t())
