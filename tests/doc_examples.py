"""The user documentation (README.md and the guide under docs/guide/) and the `curl` calls it shows, parsed as a
user would type them: tests run every one against the bundled demo models and check the links between pages."""

from __future__ import annotations

import json
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "guide"


def user_docs() -> list[Path]:
    """README.md first, then the guide's pages in name order."""
    return [README, *sorted(GUIDE.glob("*.md"))]


@dataclass
class Call:
    """One documented `curl -s [-X METHOD] localhost:8000/PATH [-H 'name: value']... [-d 'JSON']`."""

    doc: Path
    line: int
    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    body: dict | None = None

    def __str__(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}: {self.method} {self.path}"


CURL = re.compile(r"curl -s (?:-X (?P<method>[A-Z]+) )?'?localhost:8000(?P<path>/[^\s']*)'?"
                  r"(?P<headers>(?: -H '[^']*')*)(?: -d '(?P<body>[^']*)')?")


def curl_calls(doc: Path) -> list[Call]:
    """Every call `doc` shows, in order. Each line that starts a `curl` command must be one of them, so an example
    written another way fails here instead of going untested."""
    text = doc.read_text()
    calls = []
    for match in CURL.finditer(text):
        headers = dict(h.split(": ", 1) for h in re.findall(r"-H '([^']*)'", match["headers"]))
        body = json.loads(match["body"]) if match["body"] is not None else None
        method = match["method"] or ("POST" if body is not None else "GET")
        calls.append(Call(doc, text.count("\n", 0, match.start()) + 1, method, match["path"], headers, body))
    starts = [i + 1 for i, line in enumerate(text.splitlines()) if line.lstrip().startswith("curl ")]
    assert starts == [c.line for c in calls], f"{doc.name}: curl lines {starts}, parsed {[c.line for c in calls]}"
    return calls


CLIENT_IMPORT = "from nextstep.client import"


def python_examples(doc: Path) -> list[tuple[int, str]]:
    """Every indented code block of `doc` that starts with an import of the Python client: (its first line, its
    code, dedented), in order."""
    lines = doc.read_text().splitlines()
    examples, i = [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("    ") and line.lstrip().startswith(CLIENT_IMPORT):
            indent = " " * (len(line) - len(line.lstrip()))
            j = i
            while j < len(lines) and (not lines[j].strip() or lines[j].startswith(indent)):
                j += 1
            examples.append((i + 1, textwrap.dedent("\n".join(lines[i:j])).strip() + "\n"))
            i = j
        else:
            i += 1
    return examples
