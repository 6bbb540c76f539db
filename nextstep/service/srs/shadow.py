"""Shadow rollouts (issue 35). After each write through the serving version for a user in a shadow's fraction, the
candidate takes a turn off the request path (core.StatefulTask.shadow, `follow_log`), from what the write queued
(`ShadowTurn`: the reviews, each one's window just before it, the user's state before the write). Of the serving
layout, the candidate shares the user's reviews: its turn is its P(recall) of each review the serving version's was
scored on, from the same window, drift sums and FSRS-6 parameters (its own defaults before a fit), recorded with role
"shadow"; nothing is stored. Of another layout, the candidate's own state of the user takes the reviews as a write
through it would (its windows, its drift sums; the user's parameters as the serving layout holds them; the event
ids), scored the same way; a state that does not end where the serving one did before the write (none yet, a turn
dropped or failed, a shadow stopped and started again) is first rebuilt from the serving layout's state as it was
just before the write (keeping the reviews it held, if it is part of the same history), so that every turn is scored;
if the serving state has moved on since, the turn stores nothing and the user's next one rebuilds. A turn that
waited while the candidate began answering the user (a canary, a promotion: on any replica) puts the write's reviews
before those the candidate took meanwhile, which are recorded again after them. While such a candidate is a canary,
its states of the users outside its fraction keep up the same way, unscored (`keep_up`: a shadow's states stay ready
through a canary to the promotion). An abort leaves those states as they are, no longer
following. A promotion finds each user of the fraction ready as of their last turn; one whose last turn was dropped
or failed, and who has written nothing since, has a state without the reviews of that write, which the promoted
version goes on from (a layout holding a state never looks at the others).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..errors import UnknownModel
from ..gate import log_losses
from ..registry import LoadedModel
from ..state import StoredState
from .layouts import _holds, _merged, _same_row, _took
from .stored import History, Review, _decode
from .windows import carried, user_feeds


@dataclass(frozen=True)
class ShadowTurn:
    """A serving write's reviews, for a shadow rollout's candidate to follow (`follow_log`, off the request path):
    the serving layout (`schema`), the user's history before the write (its recent block, the fields of the cards
    written that had one, its header), the reviews written (ROW, errors NaN), their card ids and event ids, each
    one's window just before it under the serving layout, and which of them live quality scored for the serving
    version. `keep_up`: a canary's turn (SpacedRepetition.keep_up): unscored, for a state the candidate has."""

    schema: str
    before: History
    new: np.ndarray
    cards: tuple[str, ...]
    event_ids: tuple[str, ...]
    windows: tuple[np.ndarray, ...]
    answered: np.ndarray
    keep_up: bool = False

    @property
    def scored(self) -> np.ndarray:
        return ~np.isnan(self.answered)

    @classmethod
    def of(cls, model: LoadedModel, history: History, new: np.ndarray, reviews: Sequence[Review],
           windows: Sequence[np.ndarray], answered: np.ndarray) -> ShadowTurn:
        cards = tuple(r.card_id for r in reviews)
        own = {card: history.cards[card] for card in dict.fromkeys(cards) if card in history.cards}
        rows = new.copy()
        rows["error"] = np.nan
        return cls(model.schema, replace(history, cards=own),
                   rows, cards, tuple(r.event_id for r in reviews if r.event_id is not None), tuple(windows),
                   answered)


class Shadows:
    """SpacedRepetition's part that follows a serving write for a shadow's candidate, off the request path."""

    def keep_up(self, model: LoadedModel, user_id: str, events: int, turn: Callable[[], ShadowTurn]) -> None:
        """After a write of `events` reviews through `model` while a candidate of another layout is a canary (the
        write's user outside its fraction): queue a turn for the candidate (`follow_log`, as a shadow's, unscored)
        in which its state of the user, if it has one (a shadow's, say), takes the reviews, so that it has them if
        the candidate serves the user later (a wider fraction, a promotion). A user it has no state for is rebuilt
        from the serving layout's on their first request to it. A full queue drops the turn (counted)."""
        rollout = self.rollouts.current.get(model.name) if self.rollouts is not None else None
        if (rollout is None or rollout.mode != "canary" or rollout.candidate in (None, model.version) or not events
                or self.shadows is None):
            return
        try:
            candidate = self.registry.get(model.name, rollout.candidate, task=self.TASK)
        except UnknownModel:  # (withdrawn meanwhile)
            return
        if candidate.schema == model.schema:  # (the reviews are shared)
            return
        self.queue_turn(model.name, rollout.candidate, user_id, lambda: replace(turn(), keep_up=True))

    async def follow_log(self, model: LoadedModel, user_id: str, turn: ShadowTurn) -> bool:
        """A shadow turn: the candidate `model`'s P(recall) of the reviews a serving write recorded (`turn`), each
        from its window just before it, scored for live quality (role "shadow") on the reviews the serving version's
        were scored on. Of the serving layout, the reviews are shared: scoring is all there is to do, from the
        windows the serving version read, under the user's drift sums and FSRS-6 parameters as they were. Of
        another layout, the candidate's own state of the user takes the reviews too (`_follow`). Whether its state
        was stored (or had nothing to store)."""
        new = turn.new
        if model.schema != turn.schema:
            return await self._follow(model, user_id, turn)
        if turn.scored.any():
            windows = turn.windows
            hist = user_feeds(model, windows, turn.before)
            out = await self._predict(model, windows, hist, np.arange(len(new)),
                                      *(np.ascontiguousarray(new[f]) for f in ("card", "deck", "time")),
                                      background=True)
            await self._score_shadow(model, user_id, out["recall"].astype(np.float64), turn)
        return True

    async def _follow(self, model: LoadedModel, user_id: str, turn: ShadowTurn) -> bool:
        """A shadow turn of a candidate of another layout: the reviews appended to its state of the user, as a write
        through it would append them (its windows, its drift, the user's FSRS-6 parameters as the serving layout
        holds them), with their event ids, and its P(recall) of each scored. A state that does not end where the
        serving one did before the write (none yet, a turn dropped, a shadow stopped and started again) is rebuilt
        first from the serving layout's state as it was before the write (`_before_write`); when that state has
        moved on since, the turn stores nothing and the user's next one rebuilds. A state that took reviews of its
        own after the write's place (the candidate began answering the user, a canary or a promotion, while this
        turn waited) has them recorded again after the write's (`_took`), so that none is lost. A compare-and-set on
        the candidate's key: whether it held. A canary's turn (`keep_up`) stores nothing for a user the candidate
        has no state of, and scores nothing."""
        key, new = self.key(model, user_id), turn.new
        first = int(new["seq"][0])
        stored, _ = await self.store.read(key, fields=list(dict.fromkeys(turn.cards)))
        if turn.keep_up and not stored.exists:
            return True
        history, fields, took = _decode(stored), {}, None
        if stored.exists and history.count >= first + len(new) and _holds(history.recent, new[-1]):
            return True  # (it has them: rebuilt after the write)
        before = turn.before.recent
        if not (stored.exists and history.count == first
                and (_same_row(history.recent[-1], before[-1]) if len(before) else not len(history.recent))):
            rebuilt = await self._before_write(model, user_id, turn, stored)
            if rebuilt is None:
                return True
            history, fields, took = rebuilt
        history = replace(history, fit=turn.before.fit)  # the parameters and day boundary the serving layout holds
        after, touched, recall = await self._append(model, history, new, turn.cards)
        if took is not None:  # (the candidate's own reviews, after the write's)
            rows, cards = took
            rows = rows.copy()
            rows["seq"] = np.arange(after.count, after.count + len(rows))
            after, later, _ = await self._append(model, after, rows, cards)
            touched.update(later)
        written = await self.store.compare_and_set(key, stored.version, after.blob(), after.count - stored.events,
                                                   list(turn.event_ids),
                                                   fields={**fields, **{c: r.tobytes() for c, r in touched.items()}})
        if written is None:
            return False
        if not turn.keep_up:
            await self._score_shadow(model, user_id, recall, turn)
        return True

    async def _before_write(self, model: LoadedModel, user_id: str, turn: ShadowTurn, target: StoredState
                            ) -> tuple[History, dict[str, bytes], tuple[np.ndarray, list[str]] | None] | None:
        """The user's state under `model`'s layout as it would have been just before the serving write of `turn`
        (its state `target` is missing or lags), the fields to write, and the reviews that state took itself
        after the write's place (`_took`: to record again after the write's; None: none). The state: the
        reviews the serving layout held then, with those the lagging state holds if it is a part of the same history
        (its last review, but for those it took, among those held then; else it is replaced, its other cards
        emptied), laid out for this layout's windows (`carried`), with
        the serving header as it was. The reviews held then: the recent block and the written cards' fields as the
        turn kept them, and every other card's field as the serving layout holds it now, which the write left as
        it was. None when the serving state holds other reviews than those up to the write's now (another write came
        since: its own turn rebuilds; or none)."""
        now = await self.store.read_all(self._key_of(model, turn.schema, user_id))
        source = _decode(StoredState(now.version, now.events, now.updated, now.blob))  # (the fields as they are)
        new, b = turn.new, turn.before
        first = int(new["seq"][0])
        if source.count != first + len(new) or not _holds(source.recent, new[-1]):
            return None
        written = set(turn.cards)
        held = {card: rows for card, rows in now.fields.items() if card not in written}
        held.update({card: rows.tobytes() for card, rows in b.cards.items()})
        recent, emptied, took = b.recent, {}, None
        if target.exists:
            from .refit import stored_rows

            own = await self.store.read_all(self.key(model, user_id))
            took = _took(own, stored_rows(b.recent, held), float(new["time"][-1]))
            merged = _merged(own if took is None else took[2], b.recent, held)  # (wider windows keep what it held)
            if merged is not None:
                recent, held = merged
            else:
                emptied, took = {card: b"" for card in own.fields if card not in held}, None
        recent, cards, _ = carried(recent, held, model.extra.window)
        if (int(recent["seq"][-1]) + 1 if len(recent) else 0) != first:
            return None
        return (replace(b, stored=target, recent=recent, cards=cards),
                {**emptied, **{card: rows.tobytes() for card, rows in cards.items()}}, took and took[:2])

    async def _score_shadow(self, model: LoadedModel, user_id: str, recall: np.ndarray, turn: ShadowTurn) -> None:
        """Live quality of a follower (a shadow's candidate; under a gated canary, the serving version): its
        P(recall) `recall` of the reviews the answering version's was scored on; under a gate, each review's log
        loss through the candidate minus through the serving version, added to the gate's evidence (gate.py)."""
        new = turn.new
        keep = turn.scored & ~np.isnan(recall)
        if not keep.any():
            return
        recalled = (new["rating"][keep] > 1).astype(np.int64)
        p = recall[keep]
        if self.quality is not None:
            self.quality.record(model.name, model.version, np.stack([1 - p, p], axis=1), recalled, "shadow")
        if self.gated(model.name):
            followed, answered = (log_losses(np.stack([1 - x, x], axis=1), recalled) for x in (p, turn.answered[keep]))
            await self.pair(model, user_id, followed, answered)
