"""Other layouts. The stored reviews are the user's log (issue 37): a version whose window sizes differ from those of
the version that stored them finds no state under its own schema, and builds one (`_rebuild`, `carried`) from the
user's state under the newest other layout of the model that has one (`layouts`: the schemas of the model's other
loaded versions, newest first): the reviews held there (the recent block and every card's field, each once by
sequence number) laid out for its windows, with the header's card count, drift sums, scored count and FSRS-6
parameters carried over, written with the store's compare-and-set (a first write under the layout takes the rebuilt
reviews with it; a read stores it by itself, `_carry`). The answer says `rebuilt_from_events` (the reviews read; 0
otherwise) and, where the new windows are larger, `reviews_not_held` (the user's reviews the old layout no longer
held). With windows no larger, every review the new layout keeps was held, and the state equals the one the same
reviews recorded under the new layout give (each review's FSRS-6 error depends on its card's last `card_size`
reviews only, so with the same card window the errors and the drift are the same too); with larger windows the new
recent block has gaps, which `window` leaves out, until `size` newer reviews fill it. Only the first write under a
layout rebuilds: a layout that already holds a state for the user never looks at the others. A migration
(`to_migrate`, `catch_up`: POST /v1/models/{model}/migrate, `nextstep states migrate`) rebuilds every user of the
other layouts ahead of their first request; `delete` removes the user under every layout.
A request reads the blob and only the fields of the cards it names, in one round trip, and writes them
back with one compare-and-set, so the cost of a request does not grow with the number of cards a user has.
The review count is the store's event counter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..registry import LoadedModel
from ..state import StoredState
from .stored import History, _decode, _rows, id_hash
from .windows import carried


@dataclass(frozen=True)
class Moved:
    """A user's state for a layout, rebuilt from their state under another layout of the model (`carried`): the
    key it came from, the history (every card's field), the fields to write, and what the answer says of it."""

    source: str
    history: History
    fields: dict[str, bytes]
    said: dict

NOT_REBUILT = {"rebuilt_from_events": 0}

def _same_row(a: np.void, b: np.void) -> bool:
    """Whether two stored rows are one review (its sequence number, card, time and rating)."""
    return all(a[name] == b[name] for name in ("seq", "card", "time", "rating"))

def _holds(rows: np.ndarray, row: np.void) -> bool:
    """Whether `rows` (ROW, in sequence order) hold that review."""
    at = np.searchsorted(rows["seq"], row["seq"])
    return bool(at < len(rows) and _same_row(rows[at], row))

def _merged(own: StoredState, recent: np.ndarray, fields: Mapping[str, bytes]
            ) -> tuple[np.ndarray, dict[str, bytes]] | None:
    """The reviews a lagging state holds (`own`, its whole record) and those another layout holds (its recent block
    and fields), together as a recent block and fields for `carried`, if they are one history: the state's last
    review is among the others. None if not."""
    from .refit import stored_rows

    lagging = _decode(StoredState(own.version, own.events, own.updated, own.blob))
    if not len(lagging.recent) or not _holds(stored_rows(recent, fields), lagging.recent[-1]):
        return None
    return (np.concatenate([lagging.recent, recent]),
            {card: own.fields.get(card, b"") + fields.get(card, b"") for card in {*own.fields, *fields}})

def _took(own: StoredState, held: np.ndarray, since: float) -> tuple[np.ndarray, list[str], StoredState] | None:
    """Of a candidate's state (`own`, its whole record), the reviews it took itself after those it shares with the
    serving layout (`held`: the reviews that holds, ROW in sequence order), where they are its last ones, all in its
    recent block, none before `since` (the time of the serving write's last review): those reviews (ROW), their
    card ids, and the record without them. None where it is not so (no such reviews; or another history)."""
    mine = _decode(StoredState(own.version, own.events, own.updated, own.blob))
    shared = np.array([_holds(held, row) for row in mine.recent], dtype=bool)
    if not len(shared) or shared.all() or not shared[0]:
        return None
    start = int(np.argmin(shared))  # (the first not shared)
    rows = mine.recent[start:]
    ids = {id_hash(card): card for card in own.fields}
    cards = [ids.get(int(card)) for card in rows["card"]]
    if shared[start:].any() or len(rows) != mine.count - int(rows["seq"][0]) or None in cards \
            or rows["time"].min() < since:
        return None
    first = int(rows["seq"][0])
    kept = {card: _rows(value)[_rows(value)["seq"] < first].tobytes() for card, value in own.fields.items()}
    return rows, cards, StoredState(own.version, own.events, own.updated,
                                    replace(mine, recent=mine.recent[:start]).blob(),
                                    fields=kept)


class Layouts:
    """SpacedRepetition's part that reads and writes a user's state under the model's other window layouts."""

    def layouts(self, model: LoadedModel) -> list[tuple[str, tuple[int, int]]]:
        """(schema, window) of the model's other stored layouts the registry knows (its loaded versions with other
        window sizes), newest version first, each once."""
        seen, out = {model.schema}, []
        versions = [m for m in self.registry.models() if m.name == model.name and m.task == self.TASK]
        for m in sorted(versions, key=lambda m: (str(m.manifest.get("created")), m.version), reverse=True):
            if m.schema not in seen:
                seen.add(m.schema)
                out.append((m.schema, m.extra.window))
        return out

    def _key_of(self, model: LoadedModel, schema: str, user_id: str) -> str:
        """The user's key under a layout (`schema`) of the model: `key` is the one of the model's own layout."""
        return f"{self.PREFIX}:{model.name}:{schema}:{user_id}"

    async def _rebuild(self, model: LoadedModel, user_id: str, target: StoredState) -> Moved | None:
        """The user's state for `model`'s layout (which has none: `target`) rebuilt from their state under the
        newest other layout that has one (`layouts`), or None when none has: its reviews laid out for this
        layout's windows (`carried`), its card count, drift sums, scored count and FSRS-6 parameters carried over.
        What the answer says: `rebuilt_from_events` (the reviews read), and, where this layout's windows are larger,
        `reviews_not_held`: the user's reviews the old layout no longer held (the new windows lack them until newer
        reviews replace them)."""
        for schema, old_window in self.layouts(model):
            source = self._key_of(model, schema, user_id)
            stored = await self.store.read_all(source)
            if not stored.exists or not stored.blob:
                continue
            old = _decode(StoredState(stored.version, stored.events, stored.updated, stored.blob))
            if not len(old.recent):
                continue
            recent, cards, held = carried(old.recent, stored.fields, model.extra.window)
            said = {"rebuilt_from_events": held}
            size, card_size = model.extra.window
            if (size > old_window[0] or card_size > old_window[1]) and old.count > held:
                said["reviews_not_held"] = old.count - held
            history = replace(old, stored=target, recent=recent, cards=cards)
            return Moved(source, history, {card: rows.tobytes() for card, rows in cards.items()}, said)
        return None

    async def _carry(self, model: LoadedModel, user_id: str, target: StoredState) -> dict:
        """Store the user's state for `model`'s layout (which has none: `target`) rebuilt from another layout's
        (`_rebuild`), with a compare-and-set that holds only if it still has none; what the answer says of it
        (`rebuilt_from_events` 0: nothing to rebuild, or another request stored a state first)."""
        moved = await self._rebuild(model, user_id, target)
        if moved is None:
            return NOT_REBUILT
        written = await self.store.compare_and_set(self.key(model, user_id), target.version, moved.history.blob(),
                                                   moved.history.count, fields=moved.fields)
        return moved.said if written is not None else NOT_REBUILT

    async def _history(self, model: LoadedModel, user_id: str, cards: Sequence[str]) -> tuple[History, dict]:
        """(the user's history for `model` with the fields of `cards`, what the answer says of a rebuild): a user
        without a state under this layout but with one under another has it rebuilt and stored first."""
        key = self.key(model, user_id)
        history = await self._read(key, cards)
        if history.stored.exists:
            return history, NOT_REBUILT
        said = await self._carry(model, user_id, history.stored)
        return (await self._read(key, cards) if said["rebuilt_from_events"] else history), said

    async def to_migrate(self, model: LoadedModel, cursor: str = "0", count: int = 500) -> tuple[str, list[str]]:
        """A step of a walk over the users stored under the model's other layouts (`layouts`), one layout after the
        other: the cursor is "<schema>/<the store's cursor>" ("0": start, and once the walk is over)."""
        schemas = [schema for schema, _ in self.layouts(model)]
        if cursor == "0":
            at, inner = 0, "0"
        else:
            schema, sep, inner = cursor.partition("/")
            if not sep or schema not in schemas:
                raise ValueError(f"not a migration cursor of model {model.name}: {cursor!r}")
            at = schemas.index(schema)
        if at >= len(schemas):
            return "0", []
        prefix = self._key_of(model, schemas[at], "")
        following, keys = await self.store.scan(prefix, inner, count)
        if following == "0":
            following = f"{schemas[at + 1]}/0" if at + 1 < len(schemas) else "0"
        else:
            following = f"{schemas[at]}/{following}"
        return following, [k[len(prefix):] for k in keys]

    async def catch_up(self, model: LoadedModel, entity: str) -> tuple[int, bool]:
        """A user stored under another layout given a state under `model`'s (rebuilt from the newest other layout
        that has one): (reviews it was rebuilt from, True). A user who has one already costs two reads, and has it
        brought up to date where it lags (`_refresh`): (reviews it took, whether it is stored)."""
        stored = await self.store.get(self.key(model, entity))
        if stored.exists:
            return await self._refresh(model, entity, stored)
        return (await self._carry(model, entity, stored))["rebuilt_from_events"], True

    async def _refresh(self, model: LoadedModel, user_id: str, stored: StoredState) -> tuple[int, bool]:
        """The user's state under `model`'s layout (`stored`) brought up to date with their state under the newest
        other layout that has one, where it lags it: that one has more reviews, among them this one's last (the same
        history, which went on under the other layout: a shadow's state after an abort, or after a dropped turn; a
        user back on an older layout). The reviews of both, laid out for this layout's windows (`carried`), with the
        other's header, stored with a compare-and-set. (reviews it took, False when another write came first.)"""
        for schema, _ in self.layouts(model):
            source = self._key_of(model, schema, user_id)
            other = await self.store.get(source)
            if other.exists and other.blob:
                break
        else:
            return 0, True
        if _decode(other).count <= _decode(stored).count:
            return 0, True
        whole = await self.store.read_all(source)
        theirs = _decode(StoredState(whole.version, whole.events, whole.updated, whole.blob))
        own = await self.store.read_all(self.key(model, user_id))
        merged = _merged(own, theirs.recent, whole.fields)
        if merged is None:  # (another history: left as it is)
            return 0, True
        recent, cards, _ = carried(*merged, model.extra.window)
        written = await self.store.compare_and_set(
            self.key(model, user_id), own.version, replace(theirs, recent=recent).blob(), theirs.count - own.events,
            fields={card: rows.tobytes() for card, rows in cards.items()})
        return (theirs.count - own.events, True) if written is not None else (0, False)

    async def delete(self, model_name: str, entity: str) -> bool:
        """Delete the user's reviews under every layout of the model the registry knows (else another layout's would
        be rebuilt on their next request)."""
        model = self.model(model_name)
        keys = [self.key(model, entity)] + [self._key_of(model, schema, entity) for schema, _ in self.layouts(model)]
        return any([await self.store.delete(key) for key in keys])
