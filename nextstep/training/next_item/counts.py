"""Popularity and Markov: counted from the whole training split in one pass (no batches, nothing minimised).

Their fits and restorers, as their registry entries name them (families.py)."""

from dataclasses import dataclass

import numpy as np

from ...models.next_item import Markov, Popularity
from ..data import ITEM_UNKNOWN_SHARE, check_unknown_options
from .sessions import SessionData


@dataclass
class CountConfig:
    """Popularity and Markov have nothing to tune but the Markov successor list width (and, for Markov, the unknown
    row's clicks: its successors answer a click on an item added after training; popularity ignores the clicks)."""

    width: int = 100
    seed: int = 0
    min_item_count: int = 1
    unknown_share: float = ITEM_UNKNOWN_SHARE

    def __post_init__(self):
        check_unknown_options(self.min_item_count, self.unknown_share)


def fit_popularity(entry, cfg: CountConfig, train: SessionData, n_items: int, progress: bool, log: bool):
    return Popularity.fit(train.items, n_items), []


def fit_markov(entry, cfg: CountConfig, train: SessionData, n_items: int, progress: bool, log: bool):
    return Markov.fit(train.items, train.offsets, n_items, cfg.width), []


def restore_popularity(family: str, config: dict, state_dict: dict) -> Popularity:
    """Popularity with its counts as saved (their shape is data, not config)."""
    return Popularity(config["n_items"], state_dict["counts"])


def restore_markov(family: str, config: dict, state_dict: dict) -> Markov:
    """Markov with its tables as saved (their shapes are data, not config)."""
    return Markov(config["n_items"], state_dict["successors"], state_dict["counts"], state_dict["popularity"])


def sample_popularity() -> Popularity:
    """A small counted model (the registry's `sample`: the streaming contract's tests)."""
    return Popularity.fit(np.array([2, 3, 4, 2, 5, 3]), 8)


def sample_markov() -> Markov:
    return Markov.fit(np.array([2, 3, 4, 2, 5, 3]), np.array([0, 3, 6]), 8)
