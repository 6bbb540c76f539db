"""The flashcard task's commands of `nextstep` (cli.py adds them): `nextstep import-anki` (an Anki collection's reviews
as a review-log CSV, for training) and `nextstep srs refit`. Imports nothing heavy until a command runs (`nextstep
--help` stays quick)."""

import argparse
import json
from pathlib import Path


def add_commands(sub: argparse._SubParsersAction) -> None:
    anki = sub.add_parser("import-anki", help="write an Anki collection's reviews as a review-log CSV")
    anki.add_argument("collection", help="the collection: collection.anki2 (SQLite), or a .colpkg backup or .apkg "
                                          "as Anki writes it (read inside the zip, nothing unpacked)")
    anki.add_argument("--out", required=True, help="the CSV to write")
    anki.add_argument("--user-id", default="0", help="user id written in the user_id column (default 0)")
    anki.set_defaults(func=import_anki)

    srs = sub.add_parser("srs", help="flashcard maintenance (workers run off the request path)")
    srs_sub = srs.add_subparsers(dest="srs_command", required=True)
    refit = srs_sub.add_parser("refit", help="refit users' FSRS-6 parameters from their stored reviews (those due: "
                                             "NEXTSTEP_SRS_REFIT_MIN_SCORED, NEXTSTEP_SRS_REFIT_EVERY_SCORED)")
    refit.add_argument("--model", required=True, help="the srs model (NAME or NAME@VERSION)")
    refit.add_argument("--user", action="append", help="a user to refit (repeat; default: every user of the model)")
    refit.add_argument("--force", action="store_true", help="refit whatever the counts")
    refit.add_argument("--artifacts", help="artifacts directory (default: NEXTSTEP_ARTIFACTS_DIR)")
    refit.set_defaults(func=refit_command)


def refit_command(args) -> int:
    """Refit flashcard users' FSRS-6 parameters from their stored reviews (a worker: run it periodically)."""
    import asyncio

    from ...cli import _service_settings

    settings = _service_settings(args, "srs refit")
    from ..registry import ModelRegistry
    from ..stores import make_store
    from .refit import refit_all
    from .service import SpacedRepetition

    async def run() -> list[dict]:
        registry = ModelRegistry(settings.artifacts_dir, intra_op_threads=1)
        registry.reload()
        store = make_store(settings.redis_url, ttl_seconds=settings.srs_ttl_seconds or None,
                           max_event_ids=settings.max_event_ids, options=settings.redis_options())
        try:
            srs = SpacedRepetition(registry, store, None, refit_min_scored=settings.srs_refit_min_scored,
                                   refit_every_scored=settings.srs_refit_every_scored)
            return await refit_all(srs, args.model, args.user or None, force=args.force)
        finally:
            await store.close()

    done = asyncio.run(run())
    print(json.dumps({"users": len(done), "refitted": sum(bool(d.get("refitted")) for d in done)}))
    return 0


def import_anki(args) -> int:
    """Convert an Anki collection's review history into the review-log CSV."""
    import numpy as np

    from ...cli import _count
    from ...training.data import DataFormatError
    from ...training.srs.reviews import read_anki_collection, write_review_csv

    try:
        log = read_anki_collection(args.collection, user_id=args.user_id)
    except (OSError, DataFormatError) as exc:
        raise SystemExit(f"import-anki: {exc}") from None
    out = Path(args.out)
    if out.exists() and out.resolve() == Path(args.collection).resolve():
        raise SystemExit(f"import-anki: --out {out} is the collection itself; write the CSV elsewhere")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_review_csv(log, out)
    except OSError as exc:
        raise SystemExit(f"import-anki: cannot write {out}: {exc}") from None
    # every review read is in the CSV, those of deleted cards too (deck_id 0); what was skipped is not
    deleted = log.deck == 0
    decks = _count(len(np.unique(log.deck[~deleted])), "deck")
    line = f"wrote {_count(len(log), 'review')} of {_count(len(np.unique(log.card)), 'card')} to {out}"
    if deleted.any():
        line += (f": {int((~deleted).sum())} in {decks} and {int(deleted.sum())} of "
                 f"{_count(len(np.unique(log.card[deleted])), 'deleted card')} (deck_id 0: their deck is unknown)")
    else:
        line += f", in {decks}"
    skipped = log.meta.get("skipped", {})
    if skipped:
        line += f"; not written: {', '.join(f'{n} {reason}' for reason, n in skipped.items())}"
    print(line)
    hour = log.day_start_hours().get(log.user_ids[0]) if log.user_ids else None
    if hour is not None:  # what the service needs to count this user's days as the collection does
        print(f"the collection's days start at {int(hour):02d}:{round(hour % 1 * 60):02d} UTC: send "
              f'"day_start_hour_utc": {hour:g} with this user\'s reviews')
    return 0
