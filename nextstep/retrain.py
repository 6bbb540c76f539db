"""`nextstep retrain`: the closed loop's offline half. From a model's logged traffic to its next version, started as
a gated shadow that the service then promotes or aborts by itself (service/gate.py):

1. export the model's traffic from the service's Redis (`events export`'s code: train and test files split by a hash
   of the entity);
2. refuse, in one line saying by how much, a traffic too small to train on;
3. train the model's family with the settings of the version serving now (its manifest's `train_config`), or tune
   them first (`nextstep tune`, with a time budget), through the same commands a user runs, in a child process;
4. write the new version into the artifacts folder (the next number after the model's numbered versions);
5. with a service URL: reload it, and start the new version as a gated shadow of every entity (the service then
   promotes or aborts it by itself);
6. say what it did in one summary (learners and events used, the new version's held-out metrics beside the serving
   version's, the rollout started).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIN_ENTITIES = 10  # learners (sessions, users) the traffic must hold to train on: fewer leave nothing to validate on
MIN_EVENTS = 100


class TooSmall(ValueError):
    """The traffic holds too little to train on."""


def serving_manifest(artifacts: Path, model: str, serving: str | None) -> dict:
    """The manifest of the version serving (`serving`, as the service says), else of the model's newest version."""
    found = []
    for path in sorted((artifacts / model).glob("*/manifest.json")):
        if path.parent.name.startswith("."):
            continue
        manifest = json.loads(path.read_text())
        manifest.setdefault("version", path.parent.name)
        found.append(manifest)
    if not found:
        raise ValueError(f"no artifact of model {model!r} under {artifacts}: train its first version with "
                         "`nextstep train`")
    if serving is not None:
        chosen = [m for m in found if str(m["version"]) == serving]
        if chosen:
            return chosen[0]
    return max(found, key=lambda m: str(m.get("created", "")))


def next_version(artifacts: Path, model: str) -> str:
    """The number after the model's numbered versions (1 when it has none): a folder name that sorts after them."""
    numbers = [int(p.name) for p in (artifacts / model).iterdir() if p.is_dir() and re.fullmatch(r"\d+", p.name)]
    return str(max(numbers, default=0) + 1)


def export_traffic(model: str, task: str, artifacts: Path, out: Path, redis_url: str, options: dict) -> dict:
    from .service.event_export import export_events
    from .service.stores import make_store

    async def run() -> dict:
        store = make_store(redis_url, ttl_seconds=None, options=options)
        try:
            # (flashcards: every user trains; the family holds out each user's latest reviews itself, and never
            # reads a test file of other users)
            return await export_events(store, task, model, out, artifacts=artifacts,
                                       test_fraction=0.0 if task == "srs" else 0.2)
        finally:
            await store.close()

    return asyncio.run(run())


def check_size(summary: dict) -> None:
    entities = sum(summary["entities"].values())
    events = sum(summary["events"].values())
    short = []
    if entities < MIN_ENTITIES:
        short.append(f"{entities} entities ({MIN_ENTITIES} needed: {MIN_ENTITIES - entities} more)")
    if events < MIN_EVENTS:
        short.append(f"{events} events ({MIN_EVENTS} needed: {MIN_EVENTS - events} more)")
    if short:
        raise TooSmall(f"the traffic is too small to train on: {' and '.join(short)}; let it grow and run retrain "
                       "again")


def train_command(family: str, data: Path, out: Path, config: Path, tune: float | None, report: Path) -> list[str]:
    cli = [sys.executable, "-m", "nextstep.cli"]
    if tune is not None:
        return [*cli, "tune", family, "--data", str(data), "--out", str(out), "--config", str(config), "--timeout",
                str(int(tune)), "--quiet"]
    return [*cli, "train", family, "--data", str(data), "--out", str(out), "--config", str(config), "--json",
            str(report), "--quiet"]


def start_shadow(url: str, api_key: str | None, model: str, version: str) -> dict:
    """Reload the service and put `version` on every entity as a gated shadow."""
    from .client import Client, InvalidRequest

    with Client(url, api_key=api_key, timeout=60.0) as client:
        client.models.reload()
        try:
            rollout = client.models.set_rollout(model, version, fraction=1.0, mode="shadow", gate={})
        except InvalidRequest as exc:
            return {"started": False, "why": exc.detail}
        return {"started": True, "gated": True, **rollout.model_dump(mode="json", exclude_none=True)}


def retrain(model: str, artifacts: Path, *, redis_url: str, redis_options: dict, url: str | None = None,
            api_key: str | None = None, tune: float | None = None, keep_data: Path | None = None, log=print) -> dict:
    from .training.families import family

    started = time.monotonic()
    serving = None
    if url is not None:
        from .client import Client

        with Client(url, api_key=api_key) as client:
            serving = client.models.rollout(model).serving
    base = serving_manifest(artifacts, model, serving)
    entry = family(base["family"])
    work = Path(tempfile.mkdtemp(prefix=f"nextstep-retrain-{model}-"))
    data = keep_data or work / "data"
    try:
        exported = export_traffic(model, base["task"], artifacts, data, redis_url, redis_options)
        log(f"retrain: exported {sum(exported['entities'].values())} entities, {sum(exported['events'].values())} "
            f"events of {model} into {data}")
        check_size(exported)
        config = work / "config.json"
        derived = {"n_questions", "n_cats", "n_items", "n_skills", "n_problems", "similarity"}
        train_config = {k: v for k, v in base.get("train_config", {}).items() if k not in derived}
        if isinstance(train_config.get("model"), dict):
            train_config["model"] = {k: v for k, v in train_config["model"].items() if k not in derived}
        config.write_text(json.dumps(train_config))
        version = next_version(artifacts, model)
        out = artifacts / model / version
        report = work / "train.json"
        # (a study writes its folder as it goes: it runs in the work folder, and its artifact is moved in at the end)
        made = work / "tuned" if tune is not None else out
        command = train_command(entry.name, data, made, config, tune, report)
        log(f"retrain: {'tuning' if tune is not None else 'training'} {entry.name} version {version} with the "
            f"settings of version {base['version']}: {' '.join(command[2:])}")
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            if tune is None:
                shutil.rmtree(out, ignore_errors=True)
            raise RuntimeError(f"retrain: {' '.join(command[2:4])} failed ({done.returncode}):\n"
                               f"{(done.stderr or done.stdout)[-3000:]}")
        if tune is not None:  # (beside the artifact: the study, its trials and report, kept with it)
            partial = out.with_name(f".{out.name}.retrain")
            shutil.copytree(made, partial)
            partial.rename(out)
        manifest = json.loads((out / "manifest.json").read_text())
        summary = {"model": model, "family": entry.name, "serving": str(base["version"]), "version": version,
                   "artifact": str(out), "traffic": {"entities": exported["entities"], "events": exported["events"]},
                   "metrics": manifest.get("metrics", {}).get("test", {}),
                   "serving_metrics": base.get("metrics", {}).get("test", {}),
                   "tuned": tune is not None, "seconds": round(time.monotonic() - started, 1)}
        if url is not None:
            summary["rollout"] = start_shadow(url, api_key, model, version)
        return summary
    finally:
        shutil.rmtree(work, ignore_errors=True)
