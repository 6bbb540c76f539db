"""Knowledge tracing's traffic as training data (event_export.py): each learner's logged answers in the long format
that `nextstep train` reads (learner_id, question_id, response, timestamp; ids as the app sent them), and
`metadata.json` with the model's number of response categories."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from ..event_export import LogExport, manifests
from ..state import LogRow
from .service import logged_event


def _row(entity: str, row: LogRow) -> list:
    event = logged_event(row)
    return [entity, event.question_id, event.response, int(row.time)]


@dataclass(frozen=True)
class AnswerExport(LogExport):
    n_cats: int | None = None  # the newest version's response categories (metadata.json)

    def for_model(self, artifacts: Path | None, model: str) -> AnswerExport:
        found = manifests(artifacts, model)
        return replace(self, n_cats=((found[0].get("responses") or {}).get("n_cats") if found else None))

    def beside(self) -> dict[str, str]:
        return {"metadata.json": json.dumps({"n_cats": int(self.n_cats)}) + "\n"} if self.n_cats else {}


EXPORT = AnswerExport("kt", ("{model}_train.csv.gz", "{model}_test.csv.gz"), ",",
                      ("learner_id", "question_id", "response", "timestamp"), _row)
