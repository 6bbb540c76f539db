"""The user documentation holds together: the README stays short, every relative link in it and in the guide
(docs/guide/) leads to a file (and heading) that exists, every setting and every route is documented in the guide,
`make run PORT=...` serves on that port, and the API's own description names all three tasks. Fast: no server
(the documented calls themselves run in tests/service/test_demo_served.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nextstep.service.settings import Settings
from tests.doc_examples import GUIDE, README, ROOT, curl_calls, user_docs

README_MAX_LINES = 160  # the project's rule: what it is, the two commands, one call per task, where to go next
CLI_VARIABLES = {"NEXTSTEP_DEMO", "NEXTSTEP_TRACEBACK", "NEXTSTEP_DATA_DIR"}  # read outside Settings
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    text = re.sub(r"^( {4}|\t).*$", "", doc.read_text(), flags=re.MULTILINE)  # code blocks hold no headings
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}


def _guide_text() -> str:
    return "\n".join(p.read_text() for p in sorted(GUIDE.glob("*.md")))


def test_the_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move detail into docs/guide/"


@pytest.mark.parametrize("doc", user_docs(), ids=lambda p: p.name)
def test_every_relative_link_leads_somewhere(doc):
    broken = []
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(f"{target}: no {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_links_every_guide_page():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in LINK.findall(README.read_text())}
    missing = [p.name for p in GUIDE.glob("*.md") if p.resolve() not in linked]
    assert not missing, f"guide pages the README does not lead to: {missing}"


def test_every_setting_is_in_the_settings_table():
    operations = (GUIDE / "operations.md").read_text()
    names = {f"NEXTSTEP_{name.upper()}" for name in Settings.model_fields} | CLI_VARIABLES
    missing = sorted(n for n in names if f"`{n}`" not in operations and f"`{n}=" not in operations)
    assert not missing, f"settings missing from docs/guide/operations.md: {missing}"


def test_every_route_is_documented_in_the_guide():
    """Each (method, path) of the OpenAPI document appears in the guide, as a curl call or as `METHOD /path`
    (path parameters written as `{name}` or as a real value)."""
    text = _guide_text()
    shown = [(m, p) for m, p in re.findall(r"\b(GET|POST|PUT|DELETE) (/[^\s`]*)", text)]
    for method_list, path in re.findall(r"\b((?:GET|POST|PUT|DELETE)(?:`?/`?(?:GET|POST|PUT|DELETE))+) (/[^\s`]*)",
                                        text):
        shown += [(m, path) for m in re.findall(r"GET|POST|PUT|DELETE", method_list)]
    shown += [(c.method, c.path.partition("?")[0]) for p in sorted(GUIDE.glob("*.md")) for c in curl_calls(p)]
    routes = json.loads((ROOT / "openapi" / "openapi.json").read_text())["paths"]
    missing = []
    for path, methods in routes.items():
        pattern = re.compile(re.sub(r"\\\{[^}]+\\\}", r"[^/\\s]+", re.escape(path)) + r"$")
        for method in methods:
            if not any(m == method.upper() and pattern.match(p) for m, p in shown):
                missing.append(f"{method.upper()} {path}")
    assert not missing, f"routes the guide does not document: {missing}"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_run_takes_a_port():
    venv = Path(sys.prefix)  # the environment running the tests has bin/nextstep, which `run` depends on
    assert (venv / "bin" / "nextstep").exists()
    printed = subprocess.run(["make", "-n", "run", "PORT=8080", f"VENV={venv}"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    assert f"{venv}/bin/nextstep serve --demo --port 8080" in printed
    without_port = {k: v for k, v in os.environ.items() if k != "PORT"}
    printed = subprocess.run(["make", "-n", "run", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True,
                             check=True, env=without_port).stdout
    assert "--port 8000" in printed


def test_the_api_description_names_every_task():
    description = json.loads((ROOT / "openapi" / "openapi.json").read_text())["info"]["description"]
    for task in ("knowledge tracing", "next-item", "flashcards"):
        assert task in description, description


def test_the_folders_the_readme_writes_into_are_ignored_by_git():
    """What the README's commands write (`--out` folders) never shows up as untracked files in a clone."""
    outs = sorted(set(re.findall(r"--out (\S+)", README.read_text())))
    assert "artifacts/deep_gpcm/1" in outs
    for out in outs:
        result = subprocess.run(["git", "check-ignore", "-q", out], cwd=ROOT)
        assert result.returncode == 0, f"{out} is not ignored by .gitignore"
