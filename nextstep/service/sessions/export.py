"""Sessions' traffic as training data (event_export.py): each session's clicks in GRU4Rec's TSV (SessionId, ItemId,
Time), the files `nextstep train gru4rec` reads."""

from ..event_export import LogExport
from ..state import LogRow


def _row(entity: str, row: LogRow) -> list:
    return [entity, row.payload.decode(), int(row.time)]


EXPORT = LogExport("sess", ("{model}_train_full.tsv.gz", "{model}_test.tsv.gz"), "\t", ("SessionId", "ItemId", "Time"),
                   _row)
