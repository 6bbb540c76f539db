"""`nextstep` command line.

    train        train a registered family on a data set, evaluate it on held-out data, export it
    tune         tune a family's settings on a data set within a time budget (Optuna), then train and export the best
    evaluate     re-measure an artifact on a data set's held-out data
    export       export an artifact's weights again through its family's exporter
    banks build  rebuild a SimAKT artifact's memory banks from training students
    serve        serve the artifacts over HTTP
    openapi      write the service's OpenAPI document (openapi/openapi.json)
    score        score whole histories offline through the exported graphs
    states migrate  rebuild every learner's or session's state for a version from their event logs
    events export   write the event logs the service keeps as training files
    (and each task's own: `nextstep import-anki`, `nextstep srs refit`: nextstep/service/srs/commands.py)
    demo         train small models on generated data and replay a learner through ONNX Runtime

`train`, `evaluate` and `export` are built from the family registry (nextstep/training/families.py).
"""

import argparse
import contextlib
import glob
import importlib
import importlib.util
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from .cpus import configure_threads
from .demo import require
from .service import TASK_MODULES, package
from .training.families import FAMILIES, family
from .training.families import above_zero as _above_zero
from .training.families import int_in as _int_in


def _config(args, entry):
    """The family's training config from --config and the flags; unknown keys and bad values are refused before
    any data is read."""
    flags = {flag: getattr(args, flag) for flag in ALL_FLAGS if getattr(args, flag, None) is not None}
    for flag in flags:
        if flag not in entry.flags:
            raise SystemExit(f"--{flag} does not apply to {args.model}")
    try:
        return entry.read_train_config(args.config, flags)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def _options(args, entry, mapping: dict, command: str) -> dict:
    """The keywords of the family's train or evaluate function from the options given (an option left out keeps
    the function's default); an option given that the family does not take is an error naming it."""
    given = {o for o in ALL_OPTIONS[command] if (v := getattr(args, o, None)) is not None and v is not False}
    wrong = sorted(given - set(mapping))
    if wrong:
        flags = ", ".join("--" + o.replace("_", "-") for o in wrong)
        takes = ", ".join("--" + o.replace("_", "-") for o in mapping) or "none of them"
        raise SystemExit(f"{flags}: not an option of {command} {entry.name} (it takes {takes})")
    kwargs = {}
    for option, keyword in mapping.items():
        if option not in given:
            continue
        value = getattr(args, option)
        if isinstance(keyword, tuple):  # (keyword, "module:function" that turns the option into the value)
            keyword, convert = keyword
            module, _, name = convert.partition(":")
            try:
                value = getattr(importlib.import_module(module), name)(value)
            except ValueError as exc:
                raise SystemExit(f"--{option.replace('_', '-')} {value}: {exc}") from None
        kwargs[keyword] = value
    return kwargs


def cmd_train(args) -> int:
    require("torch", "train", "nextstep train")
    entry = family(args.model)
    out = Path(args.out or f"artifacts/{args.model}/{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    _check_train_out(out, args.force)  # found before training, not after it
    kwargs = _options(args, entry, entry.train_options, "train")
    cfg = _config(args, entry)
    if entry.progress:
        kwargs[entry.progress] = not args.quiet
    train = entry.resolve("train")
    user_error = entry.resolve("user_error") or ()
    # trained into a hidden folder beside OUT (serve skips it, evaluate says what it is) and renamed to OUT only
    # when the artifact is complete: an interrupted or failed run never leaves a half-written OUT behind
    partial = out.absolute().with_name(f".{out.absolute().name}{PARTIAL}{os.getpid()}")
    started = time.monotonic()
    try:
        manifest = train(entry, args.data, partial, cfg=cfg, **kwargs)
        _install(partial, out)
    except user_error as exc:
        raise SystemExit(f"train {entry.name}: {exc}") from None
    except KeyboardInterrupt:
        print(f"nextstep train: interrupted; {out} was left as it was" if out.exists() else
              f"nextstep train: interrupted; nothing was written to {out}", file=sys.stderr)
        return INTERRUPTED
    finally:
        _remove(partial)
    if args.json:
        Path(args.json).write_text(json.dumps({"artifact": str(out), "metrics": manifest["metrics"],
                                               "parity": manifest["parity"], "training": manifest["training"]},
                                              indent=2) + "\n")
    print("\n".join(_train_summary(out, manifest, time.monotonic() - started)))
    return 0


TUNE_OPTIONS = ("format", "day_columns", "duration_cap_s")  # options of train that tune passes on (reading the data)
TUNE_KEEP = ("study.db", "study.db-journal", "study.db-wal", "study.db-shm")  # what --force keeps of a tuned OUT


def cmd_tune(args) -> int:
    """Tune a family on a data set (training/tune.py), then train the best settings on the whole training file
    through the family's run (as `train` does), its test file read once, and write the artifact, the study's
    trials.csv, report.html and config.json into --out."""
    require("torch", "train", "nextstep tune")
    require("optuna", "train", "nextstep tune")
    from dataclasses import replace

    from .training import tune

    entry = family(args.model)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise SystemExit(f"tune: --out {out} is a file, not a directory")
    if (out / "manifest.json").is_file() and not args.force:
        raise SystemExit(f"tune: --out {out} holds a tuned artifact already; --force goes on with its study and "
                         "replaces the artifact, or give another directory")
    options, train_kwargs = {}, {}
    for option in TUNE_OPTIONS:
        value = getattr(args, option, None)
        if value is None:
            continue
        if option not in entry.train_options:
            raise SystemExit(f"--{option.replace('_', '-')}: not an option of {entry.name}")
        keyword = entry.train_options[option]
        options[keyword] = train_kwargs[keyword] = value
    try:
        entry.read_train_config(args.config)  # refused here, before any data is read
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    base = json.loads(Path(args.config).read_text()) if args.config else {}
    if args.device and "device" not in entry.config_fields("train_config"):
        raise SystemExit(f"tune: --device: {entry.name} trains on the CPU only")
    storage = args.storage or f"sqlite:///{(out / 'study.db').absolute()}"
    try:
        summary = tune.run_study(entry, args.data, out, base=base, timeout=args.timeout, trials=args.trials,
                                 storage=storage, jobs=args.jobs, seed=args.seed, metric=args.metric,
                                 pruner=args.pruner, device=args.device, progress=not args.quiet, options=options)
    except KeyboardInterrupt:
        print(f"nextstep tune: interrupted; the study is kept in {tune._public(storage)}: the same command goes on "
              "where it stopped", file=sys.stderr)
        return INTERRUPTED
    best = {**base, **summary["best"]["config"],
            "model": {**base.get("model", {}), **summary["best"]["config"].get("model", {})}}
    if not best["model"]:
        del best["model"]
    config = out / "config.json"
    config.write_text(json.dumps(best, indent=2) + "\n")
    cfg = _config(argparse.Namespace(model=entry.name, config=str(config)), entry)  # as `train --config` reads it
    if args.device:
        cfg = replace(cfg, device=args.device)
    if entry.progress:
        train_kwargs[entry.progress] = not args.quiet
    print(f"tune: best validation {summary['metric']} {summary['best']['value']:.4f} (trial "
          f"{summary['best']['trial']}; the defaults' {_fmt(summary['defaults']['value'])}); training it on the "
          "whole training file", file=sys.stderr, flush=True)
    partial = out.absolute().with_name(f".{out.absolute().name}{PARTIAL}{os.getpid()}")
    started = time.monotonic()
    user_error = entry.resolve("user_error") or ()
    try:
        manifest = entry.resolve("train")(entry, args.data, partial, cfg=cfg, **train_kwargs)
        held_out = manifest["metrics"].get("test", manifest["metrics"].get("valid"))
        manifest["study"] = {**summary, "test": held_out, "final_seconds": round(time.monotonic() - started, 1)}
        (partial / "manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
        with _uninterrupted():
            for old in out.iterdir():
                if old.name not in TUNE_KEEP:
                    shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
            for path in sorted(partial.iterdir(), key=lambda p: p.name == "manifest.json"):  # the manifest last
                path.rename(out / path.name)
        config.write_text(json.dumps(best, indent=2) + "\n")
    except user_error as exc:
        raise SystemExit(f"tune {entry.name}: {exc}") from None
    except KeyboardInterrupt:
        print("nextstep tune: interrupted while training the best settings; the study is kept, the artifact was not "
              "written: run the same command with --force", file=sys.stderr)
        return INTERRUPTED
    finally:
        _remove(partial)
    import optuna

    study = optuna.load_study(study_name=summary["study"], storage=tune.make_storage(storage))
    tune.write_trials_csv(study, out / "trials.csv")
    tune.write_report(study, out / "report.html", summary, held_out)
    if args.save_config:
        Path(args.save_config).write_text(config.read_text())
    if args.json:
        Path(args.json).write_text(json.dumps({"artifact": str(out), "study": manifest["study"]}, indent=2,
                                              default=str) + "\n")
    trials = summary["trials"]
    print("\n".join([
        f"study {summary['study']}: {trials['complete']} trials complete, {trials['pruned']} pruned, "
        f"{trials['fail']} failed ({trials['this_run']} in this run, {summary['seconds']:.0f} s)",
        f"validation {summary['metric']}: defaults {_fmt(summary['defaults']['value'])}, best "
        f"{summary['best']['value']:.4f}",
        *_train_summary(out, manifest, time.monotonic() - started)[:2],
        f"settings: {config}{f' and {args.save_config}' if args.save_config else ''} (nextstep train {entry.name} "
        f"--config {args.save_config or config}); report: {out / 'report.html'}, {out / 'trials.csv'}"]))
    return 0


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4f}"


# the held-out metrics the line `train` ends with shows, where the task has them (knowledge tracing, sessions,
# flashcards)
HEADLINE = ("auc", "nll", "qwk", "recall@20", "mrr@20", "log_loss", "rmse_bins", "duration_mae_s")


def _train_summary(out: Path, manifest: dict, seconds: float) -> list[str]:
    """The lines `train` ends with: the held-out metrics next to the baseline's (the manifest's `metrics.baseline`,
    or a flashcard run's FSRS-6), the artifact and the `seconds` the run took, and how to serve it."""
    from .training.loop import duration

    metrics = manifest["metrics"]
    split = "test" if "test" in metrics else "valid"
    held_out = metrics[split]
    baseline = metrics.get("baseline") or {"name": "FSRS-6", **held_out.get("baselines", {}).get("fsrs6", {})}
    shown = [f"{key} {held_out[key]:.4f}" + (f" ({baseline['name']} {baseline[key]:.4f})"
                                              if isinstance(baseline.get(key), float) else "")
             for key in HEADLINE if isinstance(held_out.get(key), float)]
    root = out.parent.parent if len(out.parts) >= 3 else out.absolute().parent.parent
    return [f"{split}: {'  '.join(shown) or held_out.get('skipped', 'no metrics')}",
            f"artifact: {out} (the run took {duration(seconds)})",
            f"serve it: nextstep serve --artifacts {root} (every MODEL/VERSION folder under it: this one is model "
            f"{out.parent.name!r}, version {out.name!r})"]


PARTIAL = ".partial-"  # .OUT.partial-PID: a training run's artifact until it is complete
INTERRUPTED = 130  # the exit status of a command ended by Ctrl-C (128 + SIGINT), as shells report it


def _check_train_out(out: Path, force: bool) -> None:
    """Refuse an --out that is a file, an artifact already there (unless --force) or a folder of other files."""
    if out.exists() and not out.is_dir():
        raise SystemExit(f"train: --out {out} is a file, not an artifact directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not (out / "manifest.json").is_file():
        raise SystemExit(f"train: --out {out} is a folder holding other files, not an artifact: give a new or "
                         "empty directory")
    if not force:
        raise SystemExit(f"train: --out {out} holds an artifact already; --force replaces it (once the new one "
                         "is complete), or give another directory")


def _install(partial: Path, out: Path) -> None:
    """Move a complete artifact to `out`, replacing the artifact there (the run's --force) or an empty folder."""
    with _uninterrupted():
        if out.is_dir() and any(out.iterdir()):
            old = out.with_name(f".{out.name}.replaced-{os.getpid()}")
            out.rename(old)
            partial.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            partial.replace(out)  # over an empty folder, or where there is none


def _remove(path: Path) -> None:
    """Delete a folder of ours, all of it."""
    if path.exists():
        with _uninterrupted():
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _uninterrupted():
    """Ctrl-C is ignored inside (a second one does not stop a rename or a removal halfway)."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread sees signals
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _unfinished(path: Path) -> list[Path]:
    """The folders of training runs into `path` that have not finished (interrupted, killed or still running)."""
    return sorted(path.parent.glob(f".{glob.escape(path.name)}{PARTIAL}*")) if path.name else []


def _artifact_family(artifact: str, command: str):
    path = Path(artifact)
    if path.name.startswith(".") and PARTIAL in path.name:
        raise SystemExit(f"{command}: {artifact} is an unfinished training run (interrupted, killed or still "
                         "running), not an artifact: train again (a finished run renames its folder to --out)")
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        return family(str(manifest.get("family")))
    except (OSError, ValueError) as exc:
        unfinished = _unfinished(path)
        why = f"; an unfinished training run into it is in {unfinished[-1]}" if unfinished else ""
        raise SystemExit(f"{command}: {artifact} is not a readable artifact: {exc}{why}") from None


def cmd_export(args) -> int:
    """Export an artifact's weights again (to ONNX, TorchScript, manifest) through the family's exporter."""
    require("torch", "train", "nextstep export")
    from .training.export import ParityError, reexport
    from .training.families import restore

    entry = _artifact_family(args.artifact, "export")
    if Path(args.out).resolve() == Path(args.artifact).resolve():
        raise SystemExit("export: --out must be a new directory, not the artifact itself")
    if Path(args.out).exists() and (not Path(args.out).is_dir() or any(Path(args.out).iterdir())):
        raise SystemExit(f"export: --out {args.out} exists and is not an empty directory (a re-export would mix "
                         "its files with what is there)")
    manifest = json.loads((Path(args.artifact) / "manifest.json").read_text())
    if not (Path(args.artifact) / str(manifest.get("parity", {}).get("inputs"))).is_file():
        raise SystemExit(f"export: {args.artifact} has no parity sequences to check a re-export on (exported "
                         "before parity.npz existed): train it again")
    try:
        manifest = reexport(Path(args.artifact), Path(args.out), entry.resolve("exporter"), restore)
    except ParityError as exc:
        raise SystemExit(f"export: {exc}") from None
    print(json.dumps({"artifact": args.out, "parity": manifest["parity"]}, indent=2))
    return 0


def cmd_evaluate(args) -> int:
    require("torch", "train", "nextstep evaluate")
    entry = _artifact_family(args.artifact, "evaluate")
    kwargs = _options(args, entry, entry.evaluate_options, "evaluate")
    result = entry.resolve("evaluate")(args.artifact, args.data, **kwargs)
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    return 0


def cmd_banks_build(args) -> int:
    require("torch", "train", "nextstep banks build")
    if args.version is not None and not VERSION_NAME.fullmatch(args.version):  # it names ARTIFACT/banks/VERSION
        raise SystemExit(f"banks build: --version {args.version!r} must be a folder name: 1 to 64 of A-Z a-z "
                         "0-9 . _ -, not starting with a dot")
    entry = _artifact_family(args.artifact, "banks build")
    if entry.banks is None:
        with_banks = ", ".join(e.name for e in FAMILIES.values() if e.banks)
        raise SystemExit(f"banks build: {args.artifact} is a {entry.name} artifact; only {with_banks} artifacts have "
                         "banks")
    build = entry.resolve("banks")
    print(json.dumps(build(args.artifact, args.data, version=args.version, seed=args.seed), indent=2))
    return 0


def _service_settings(args, command: str):
    """The service's settings (NEXTSTEP_* variables, --artifacts), for a command that works on its Redis."""
    for module in ("fastapi", "onnxruntime"):
        require(module, "serve", f"nextstep {command}")
    from .service.settings import Settings

    settings = Settings(**({"artifacts_dir": Path(args.artifacts)} if getattr(args, "artifacts", None) else {}))
    if not settings.redis_url:
        raise SystemExit(f"nextstep {command}: set NEXTSTEP_REDIS_URL to the service's Redis (without it the state "
                         "lives inside the serving process, out of this command's reach)")
    return settings


MIGRATE_TRIES = 5  # a page the state store fails is walked again after 1, 2, 4, 8 s before `states migrate` stops


def _migrate_progress(page: dict) -> None:
    """Called after each page `states migrate` walks (a test pauses Redis here, between two pages)."""


def cmd_states_migrate(args) -> int:
    """Bring every entity's state for a version up to date with its event log, a page at a time, at most --rate
    entities a second: the admin route's pages (POST /v1/models/{model}/migrate) run in this process."""
    import asyncio

    from .service.app import create_app
    from .service.errors import StoreUnavailable, UnknownModel
    from .service.tasks import plugin, stateful_task

    settings = _service_settings(args, "states migrate")

    async def run() -> dict:
        app = create_app(settings)
        async with app.router.lifespan_context(app):
            model = app.state.registry.get(args.model, args.to)
            task = stateful_task(app, model.task)
            if task is None:
                raise SystemExit(f"states migrate: {model.name} is a {model.task} model: "
                                 f"{plugin(model.task).no_migrate}")
            totals = {"model": model.name, "version": model.version, "entities": 0, "rebuilt": 0, "events": 0,
                      "lagging": 0}
            started, cursor = time.monotonic(), args.cursor
            while True:
                page_started = time.monotonic()
                for attempt in range(MIGRATE_TRIES):  # (a page may be walked again: each write is a compare-and-set)
                    try:
                        page = await task.migrate(model, cursor, args.page)
                        break
                    except ValueError as exc:
                        raise SystemExit(f"states migrate: --cursor: {exc}") from None
                    except StoreUnavailable as exc:
                        if attempt == MIGRATE_TRIES - 1:
                            raise SystemExit(f"states migrate: {exc}; {totals['entities']} entities done: resume "
                                             f"with --cursor {cursor}") from None
                        print(f"states migrate: {exc}; the page again in {2 ** attempt} s", file=sys.stderr)
                        await asyncio.sleep(2 ** attempt)
                for name in ("entities", "rebuilt", "events", "lagging"):
                    totals[name] += page[name]
                cursor = page["cursor"]
                if not args.quiet:
                    print(f"{totals['entities']} entities, {totals['rebuilt']} rebuilt from {totals['events']} "
                          f"events; cursor {cursor}", file=sys.stderr)
                _migrate_progress(page)
                if page["done"]:
                    break
                if args.rate:
                    await asyncio.sleep(max(0.0, page["entities"] / args.rate - (time.monotonic() - page_started)))
            seconds = time.monotonic() - started
            return {**totals, "seconds": round(seconds, 3),
                    "entities_per_second": round(totals["entities"] / seconds, 1) if seconds > 0 else None}

    try:
        print(json.dumps(asyncio.run(run()), indent=2))
    except (UnknownModel, StoreUnavailable) as exc:
        raise SystemExit(f"states migrate: {exc}") from None
    return 0


def cmd_events_export(args) -> int:
    """Write a model's traffic as the files `nextstep train` reads, as its task exports it (event_export.py)."""
    import asyncio

    from .service.errors import StoreUnavailable
    from .service.event_export import export_events, manifests
    from .service.stores import make_store
    from .service.tasks import plugin, plugins

    settings = _service_settings(args, "events export")
    found = manifests(settings.artifacts_dir, args.model)
    task = args.task or (found[0].get("task") if found else None)
    exported = ", ".join(p.spec.name for p in plugins() if p.export is not None)
    if task is None:
        raise SystemExit(f"events export: no artifact of {args.model!r} under {settings.artifacts_dir} to tell its "
                         f"task: pass --task ({exported})")
    if plugin(task) is None or plugin(task).export is None:
        raise SystemExit(f"events export: {args.model} is a {task} model; events are exported for {exported} models")

    async def run() -> dict:
        store = make_store(settings.redis_url, ttl_seconds=None, options=settings.redis_options())
        try:
            return await export_events(
                store, task, args.model, Path(args.out), test_fraction=args.test_fraction,
                artifacts=settings.artifacts_dir, progress=None if args.quiet else lambda c: print(
                    f"{c['entities']} entities, {c['events']} events", file=sys.stderr))
        finally:
            await store.close()

    try:
        print(json.dumps(asyncio.run(run()), indent=2))
    except StoreUnavailable as exc:
        raise SystemExit(f"events export: {exc}") from None
    return 0


def cmd_retrain(args) -> int:
    """Export a model's traffic, train (or tune) its next version with the serving version's settings, and with
    --url start it as a gated shadow (retrain.py); one summary."""
    require("torch", "train", "nextstep retrain")
    from .retrain import TooSmall, retrain

    settings = _service_settings(args, "retrain")
    # (the service's own settings: its first admin key reloads it and starts the shadow, unless one is given)
    api_key = args.api_key or os.environ.get("NEXTSTEP_RETRAIN_API_KEY") or next(iter(settings.admin_keys), None)
    try:
        summary = retrain(args.model, Path(settings.artifacts_dir), redis_url=settings.redis_url,
                          redis_options=settings.redis_options(), url=args.url, api_key=api_key,
                          tune=args.tune_timeout if args.tune else None,
                          keep_data=Path(args.keep_data) if args.keep_data else None,
                          log=lambda line: print(line, file=sys.stderr, flush=True))
    except TooSmall as exc:
        raise SystemExit(f"retrain {args.model}: {exc}") from None
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    traffic = summary["traffic"]
    metrics = "  ".join(f"{k} {v:.4f}" for k, v in summary["metrics"].items() if isinstance(v, (int, float)))
    lines = [f"retrain {summary['model']}: version {summary['version']} ({summary['family']}"
             f"{', tuned' if summary['tuned'] else ''}) from {sum(traffic['entities'].values())} entities and "
             f"{sum(traffic['events'].values())} events of traffic (train {traffic['events']['train']}, test "
             f"{traffic['events'].get('test', 0)}) in {summary['seconds']:.0f} s, settings of version "
             f"{summary['serving']}",
             f"  held-out on the traffic's test part: {metrics or '(none)'}",
             f"  artifact: {summary['artifact']}"]
    rollout = summary.get("rollout")
    if rollout is None:
        lines.append("  not started: pass --url to reload the service and start it as a gated shadow")
    elif rollout["started"]:
        lines.append(f"  started as a {'gated ' if rollout['gated'] else ''}shadow of every entity over version "
                     f"{rollout['serving']}" + ("; the gate promotes or aborts it (GET /v1/models/"
                                                f"{summary['model']}/rollout)" if rollout["gated"] else
                                                "; decide it by hand: its shadows are not gated"))
    else:
        lines.append(f"  loaded, not started as a shadow: {rollout['why']}")
    print("\n".join(lines))
    return 0


def cmd_demo(args) -> int:
    """Build every family's demo recipe (its registry entry's: generated data, brief training, export) and print
    what each shows: its held-out metrics, a GPCM learner replayed through the exported ONNX graphs."""
    require("torch", "train", "nextstep demo")
    import tempfile

    from .demo import build_one
    from .training.families import load

    work = Path(args.out or tempfile.mkdtemp(prefix="nextstep-demo-"))
    for entry in FAMILIES.values():
        if entry.demo is None:
            continue
        out = work / "artifacts" / entry.name / "demo"
        manifest = build_one(entry, work / "data" / entry.name, out, epochs=args.epochs)
        if entry.demo.show:
            lines = load(entry.demo.show)(entry.name, out, manifest)
        else:
            test = manifest["metrics"]["test"]
            lines = [f"{entry.name:15s} test: " + "  ".join(f"{k} {v:.3f}" for k, v in test.items()
                                                             if isinstance(v, float))
                     + f"   parity ok: {manifest['parity']['passed']}"]
        print("\n".join(lines))
    print(f"artifacts in {work / 'artifacts'}")
    return 0


def cmd_openapi(args) -> int:
    """Write the service's OpenAPI document (openapi/openapi.json is committed; a test fails when it drifts)."""
    require("fastapi", "serve", "nextstep openapi")
    from .service.app import create_app
    from .service.openapi import render

    path = Path(args.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(create_app()))
    print(f"wrote {path}")
    return 0


def cmd_serve(args) -> int:
    """Serve every artifact under the artifacts directory (settings from NEXTSTEP_* variables); with --demo and no
    artifacts there, the demo models bundled with the package (nextstep/demo.py), which need no torch."""
    for module in ("uvicorn", "fastapi", "onnxruntime"):
        require(module, "serve", "nextstep serve")
    from .service.settings import Settings

    settings = Settings(**({"artifacts_dir": Path(args.artifacts)} if args.artifacts else {}))
    artifacts_dir = settings.artifacts_dir
    unfinished = sorted(artifacts_dir.glob(f"*/.*{PARTIAL}*"))
    if unfinished:  # hidden folders, which the service skips: said here, where the user looks
        print(f"not served: {len(unfinished)} unfinished training run{'s' if len(unfinished) > 1 else ''} "
              f"(interrupted, killed or still running; delete the folders of runs that are over): "
              f"{', '.join(map(str, unfinished))}", file=sys.stderr)
    if not any(artifacts_dir.glob("*/*/manifest.json")):
        if not args.demo:
            raise SystemExit(f"no artifacts under {artifacts_dir}: train some (nextstep train) "
                             "or pass --demo to serve the bundled demo models")
        from .demo import BUNDLED, MODELS

        print(f"no artifacts under {artifacts_dir}: serving the bundled demo models ({', '.join(MODELS)}) from "
              f"{BUNDLED}; models trained into {artifacts_dir} are served in their place after a reload (POST "
              "/v1/models/reload) or a restart", file=sys.stderr)
        os.environ["NEXTSTEP_DEMO_ARTIFACTS_DIR"] = str(BUNDLED)
    # workers > 1 share nothing but Redis (set NEXTSTEP_REDIS_URL): each loads the models itself
    os.environ["NEXTSTEP_ARTIFACTS_DIR"] = str(artifacts_dir)
    if args.workers > 1 and not settings.redis_url:
        raise SystemExit("--workers > 1 needs NEXTSTEP_REDIS_URL: in-process state cannot be shared")
    from .service.server import run  # uvicorn with read deadlines (NEXTSTEP_HEADER/BODY_TIMEOUT_SECONDS)

    run(host=args.host, port=args.port, workers=args.workers, access_log=args.access_log, settings=settings)
    return 0


def cmd_score(args) -> int:
    """Score whole histories offline through the exported graphs (the batch route without HTTP): in this process
    (the default), or on Ray Data with --engine ray. Both run nextstep/scoring.py's Scorer."""
    require("onnxruntime", "serve", "nextstep score")
    from . import scoring
    from .service.errors import UnknownModel

    if args.engine == "ray":
        require("ray", "ray", "nextstep score --engine ray")
    try:  # before any output is opened: a wrong name leaves no file behind
        model, errors = scoring.resolve(args.artifacts, args.model)
    except UnknownModel as exc:
        raise SystemExit(f"score: {exc} (under {args.artifacts})") from None
    if errors:
        print(f"skipped broken artifacts: {errors}", file=sys.stderr)
    try:
        files, input_format = scoring.input_files(args.input)
    except scoring.ScoringError as exc:
        raise SystemExit(f"score: {exc}") from None
    output_format = args.output_format or ("parquet" if args.output and args.output.endswith(".parquet")
                                           else "jsonl")
    if "parquet" in (input_format, output_format):
        require("pyarrow", "ray", f"nextstep score with Parquet {'input' if input_format == 'parquet' else 'output'}")
    if args.engine == "ray":
        return _score_ray(args, model, files, input_format, output_format)
    if output_format == "parquet" and not args.output:
        raise SystemExit("score: Parquet output needs --output FILE")
    if args.output and Path(args.output).is_dir():
        raise SystemExit(f"score: --output {args.output} is a directory; give a file (a directory of parts is "
                         "--engine ray's output)")
    return _score_here(args, model, files, input_format, output_format)


def _score_here(args, model, files: list[Path], input_format: str, output_format: str) -> int:
    from tqdm import tqdm

    from . import scoring

    scorer = scoring.Scorer(model)
    output = Path(args.output) if args.output else None
    # written next to the output and renamed over it at the end: a failure leaves no partial or empty file
    partial = output.with_name(f".{output.name}.partial") if output else None
    n = 0
    try:
        students = scoring.read_students(files, input_format)
        # a bar on a terminal only: in a log file, tqdm's carriage-return updates are noise
        students = tqdm(students, desc="students", unit="", disable=args.quiet or not sys.stderr.isatty())
        if output_format == "parquet":
            import pyarrow.parquet as pq

            schema, chunk = scoring.result_schema(model), []
            with pq.ParquetWriter(partial, schema) as writer:
                for student in students:
                    chunk.append(scorer.score(student))
                    if len(chunk) == 1024:
                        writer.write_table(scoring.to_table(chunk, schema))
                        n, chunk = n + len(chunk), []
                writer.write_table(scoring.to_table(chunk, schema))
                n += len(chunk)
        else:
            with partial.open("w") if partial else contextlib.nullcontext(sys.stdout) as out:
                for student in students:
                    out.write(scoring.to_line(scorer.score(student)) + "\n")
                    n += 1
    except scoring.ScoringError as exc:
        if partial:
            partial.unlink(missing_ok=True)
        raise SystemExit(f"{args.input}: {exc}" if str(exc).startswith("student ") else f"score: {exc}") from None
    except BaseException:
        if partial:
            partial.unlink(missing_ok=True)
        raise
    finally:
        scorer.close()
    if partial:
        partial.replace(output)
    print(f"scored {n} students with {args.model}", file=sys.stderr)
    return 0


def _score_ray(args, model, files: list[Path], input_format: str, output_format: str) -> int:
    from . import ray_scoring, scoring

    if not args.output:
        raise SystemExit("score: --engine ray writes a directory of part files: give it with --output DIR")
    try:
        done = ray_scoring.score(model, files, input_format, Path(args.output), output_format, workers=args.workers,
                                 batch_size=args.batch_size)
    except scoring.ScoringError as exc:
        raise SystemExit(f"{args.input}: {exc}" if str(exc).startswith("student ") else f"score: {exc}") from None
    workers = f"{done['workers']} worker{'s' if done['workers'] != 1 else ''}"
    print(f"scored {done['students']} students with {args.model} on Ray ({workers}, "
          f"{done['seconds']:.1f} s after a {done['startup_seconds']:.1f} s start) into {args.output}",
          file=sys.stderr)
    return 0


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


# the options of `train` some family takes, by name (the first entry's, where several take one)
TRAIN_OPTIONS = {o.name: o for entry in reversed(FAMILIES.values()) for o in entry.options}
ALL_FLAGS = tuple(name for name, o in TRAIN_OPTIONS.items() if o.keyword is None)  # set training config fields
ALL_OPTIONS = {  # the family-specific options of each command (a family's entry says which it takes)
    "train": tuple(name for name, o in TRAIN_OPTIONS.items() if o.keyword is not None),
    "evaluate": ("format", "valid", "max_len", "banks", "day_columns", "duration_cap_s"),
}
TRUE = ("1", "true", "yes", "on")
VERSION_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")  # a bank version: a folder name
def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError("must be at least 0 and below 1")
    return value


def _train_parser(parser: argparse.ArgumentParser, entry) -> None:
    """`train NAME`'s options: those every family takes, then the family's own (its registry entry's). The others
    are there too, hidden from its help, so that giving one is refused by name (`_options`, `_config`) rather than
    as unrecognised."""
    parser.add_argument("--data", required=True, help=f"{entry.data}; formats read: "
                                                      f"{', '.join(entry.formats)} (detected)")
    parser.add_argument("--out", help="artifact directory (default artifacts/MODEL/VERSION); it is written only when "
                                      "the run is complete (until then the run's files are in .OUT.partial-PID "
                                      "beside it, removed if the run stops)")
    parser.add_argument("--force", action="store_true",
                        help="replace the artifact already in --out (by the new one, once it is complete)")
    for option in entry.options:
        parser.add_argument(option.flag, help=option.help, **option.argparse)
    own = {option.name for option in entry.options}
    for option in TRAIN_OPTIONS.values():
        if option.name not in own:
            parser.add_argument(option.flag, help=argparse.SUPPRESS,
                                **{k: v for k, v in option.argparse.items() if k != "choices"})
    parser.add_argument("--config", help="JSON file of training config fields (model overrides under 'model')")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--json", metavar="OUT", help="also write the run's result to this file (JSON: the artifact, "
                                                      "its metrics, parity and training record)")
    parser.set_defaults(func=cmd_train)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nextstep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # the table stays
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model on a data set directory, evaluate it, export it",
                           description="Train a registered family on a data set, evaluate it on held-out data, "
                                       "export it. `nextstep train MODEL --help` lists that family's options and "
                                       "the data formats it reads.")
    models = train.add_subparsers(dest="model", required=True, metavar="MODEL", help="the family to train:")
    for entry in FAMILIES.values():
        _train_parser(models.add_parser(entry.name, help=entry.help, description=f"Train {entry.name}: "
                                        f"{entry.help}. Data formats: {', '.join(entry.formats)}."), entry)

    tune = sub.add_parser(
        "tune", help="tune a family's settings on a data set within a time budget, then train and export the best",
        description="Search a family's settings (its registry entry's space) with Optuna on a validation split "
                    "carved from the training data (the test file is never opened by the study), then train the "
                    "best on the whole training file, evaluate it once on the test file and export it to --out, "
                    "beside the study's trials.csv, report.html and config.json (`train --config` takes it). Run "
                    "again, a study goes on where it stopped. docs/guide/tune.md.")
    tune.add_argument("model", choices=list(FAMILIES), metavar="MODEL", help="the family to tune: "
                      + ", ".join(FAMILIES))
    tune.add_argument("--data", required=True, help="the data set, as train takes it")
    tune.add_argument("--out", required=True, help="the folder of the study (study.db) and, at its end, the artifact")
    tune.add_argument("--timeout", type=_above_zero, default=3600.0,
                      help="wall-clock seconds of the study on this machine (default 3600); the final training "
                           "comes after it")
    tune.add_argument("--trials", type=_int_in(1), help="stop once the study has this many trials (complete or "
                                                        "pruned; default: only the time limit)")
    tune.add_argument("--storage", help="an Optuna storage URL (default sqlite:///OUT/study.db); a PostgreSQL or "
                                        "MySQL URL lets `nextstep tune` on many machines work on one study")
    tune.add_argument("--jobs", type=_int_in(1), default=1, help="trials run at once, each in its own process")
    tune.add_argument("--config", help="JSON training config the study starts from: trial 0, and the settings the "
                                       "space leaves alone (default: the family's defaults)")
    tune.add_argument("--metric", help="validation metric to optimise (default: auc, or qwk on ordinal data; "
                                       "recall@20; log_loss)")
    tune.add_argument("--pruner", choices=["median", "hyperband", "none"], default="median",
                      help="how hopeless trials are stopped on their per-epoch validation (default median)")
    tune.add_argument("--seed", type=int, default=0, help="the sampler's seed (default 0)")
    tune.add_argument("--device", help="torch device of the trials and the final training (e.g. cuda), where the "
                                       "family's training config has one")
    tune.add_argument("--format", help="the data format, where detection is wrong")
    tune.add_argument("--day-columns", choices=["check", "ignore", "trust"], help="time_aware: as in train")
    tune.add_argument("--duration-cap-s", type=_above_zero, help="time_aware: as in train")
    tune.add_argument("--save-config", metavar="FILE", help="also write the best settings here (e.g. configs/...)")
    tune.add_argument("--force", action="store_true", help="go on with the study in an --out that holds a tuned "
                                                           "artifact, and replace it")
    tune.add_argument("--quiet", action="store_true", help="no progress bar or lines")
    tune.add_argument("--json", metavar="OUT", help="also write the study's record (JSON) to this file")
    tune.set_defaults(func=cmd_tune)

    evaluate_formats = list(dict.fromkeys(f for e in FAMILIES.values() if "format" in e.evaluate_options
                                          for f in e.formats))
    evaluate = sub.add_parser("evaluate", help="re-measure an artifact on a data set's test file")
    evaluate.add_argument("artifact", help="artifact directory (the --out of train)")
    evaluate.add_argument("--data", required=True,
                          help="the data set, as train takes it: its test part is scored (*_train_valid with --valid)")
    evaluate.add_argument("--format", choices=evaluate_formats,
                          help="override detection (the formats of the artifact's family: see train MODEL --help)")
    evaluate.add_argument("--valid", action="store_true", help="next-item: evaluate on *_train_valid")
    evaluate.add_argument("--max-len", type=_int_in(1), help="score chunks of this length, each from a fresh state")
    evaluate.add_argument("--banks", help="simakt: the bank version to use (default: the one exported with it)")
    evaluate.add_argument("--day-columns", choices=["check", "ignore", "trust"],
                          help="time_aware: how a review-log CSV's day columns are read (see train)")
    evaluate.add_argument("--duration-cap-s", type=_above_zero,
                          help="time_aware: the app's answer-time cap (see train)")
    evaluate.add_argument("--json", metavar="OUT", help="also write the result (JSON) to this file")
    evaluate.set_defaults(func=cmd_evaluate)

    export = sub.add_parser("export", help="export an artifact's weights again through its family's exporter "
                                           "(ONNX, TorchScript, manifest; parity checked on its held-out sequences)")
    export.add_argument("artifact", help="artifact directory whose weights.pt is exported")
    export.add_argument("--out", required=True, help="the new artifact directory")
    export.set_defaults(func=cmd_export)

    serve = sub.add_parser("serve", help="serve the artifacts over HTTP (settings: NEXTSTEP_* variables)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    serve.add_argument("--port", type=_int_in(1, 65535), default=8000, help="port to listen on (default 8000)")
    serve.add_argument("--artifacts", help="artifacts directory (default: NEXTSTEP_ARTIFACTS_DIR or ./artifacts)")
    serve.add_argument("--demo", action="store_true", default=os.environ.get("NEXTSTEP_DEMO", "").lower() in TRUE,
                       help="with no artifacts in the artifacts directory, serve the demo models bundled with the "
                            "package (one per task; default: NEXTSTEP_DEMO=true)")
    serve.add_argument("--workers", type=_int_in(1), default=1,
                       help="worker processes (they share state through Redis)")
    serve.add_argument("--access-log", action="store_true", help="log every request (costs ~0.2 ms each)")
    serve.set_defaults(func=cmd_serve)

    openapi = sub.add_parser("openapi", help="write the service's OpenAPI document")
    openapi.add_argument("path", nargs="?", default="openapi/openapi.json",
                         help="file to write (default openapi/openapi.json)")
    openapi.set_defaults(func=cmd_openapi)

    score = sub.add_parser("score", help="score whole histories (JSONL, Parquet or CSV) into JSONL or Parquet")
    score.add_argument("input", help="a JSONL file (student_id, events, predict_question_ids), a .parquet file (the "
                                     "same columns), a .csv file (student_id, question_id, response in time order), "
                                     "a directory of .jsonl / .ndjson / .parquet parts, or a glob")
    score.add_argument("--model", required=True, help="a knowledge-tracing model (NAME or NAME@VERSION)")
    score.add_argument("--artifacts", default="artifacts", help="artifacts directory (default ./artifacts)")
    score.add_argument("--output", help="JSONL or Parquet file (default: JSONL on stdout); with --engine ray, a "
                                        "directory of part files")
    score.add_argument("--output-format", choices=["jsonl", "parquet"],
                       help="default: parquet when --output ends in .parquet, else jsonl")
    score.add_argument("--engine", choices=["local", "ray"], default="local",
                       help="local: this process (default); ray: Ray Data, one worker per CPU (the 'ray' extra; "
                            "a local Ray instance, or the cluster RAY_ADDRESS names)")
    score.add_argument("--workers", type=_int_in(1),
                       help="ray: scoring workers, a CPU each (default: one per CPU of this machine; on a cluster, "
                            "its CPUs less one, left for reading)")
    score.add_argument("--batch-size", type=_int_in(1), default=64, help="ray: students per batch a worker scores")
    score.add_argument("--quiet", action="store_true", help="no progress bar")
    score.set_defaults(func=cmd_score)


    banks = sub.add_parser("banks", help="SimAKT memory banks")
    banks_sub = banks.add_subparsers(dest="banks_command", required=True)
    build = banks_sub.add_parser("build", help="rebuild an artifact's memory banks from a data set's training "
                                               "students into ARTIFACT/banks/VERSION")
    build.add_argument("artifact", help="a simakt artifact directory")
    build.add_argument("--data", required=True, help="data set directory: its *train* file is read, never *test*")
    build.add_argument("--version", help="bank version (default: a UTC timestamp)")
    build.add_argument("--seed", type=int, default=0, help="random seed of the bank build (default 0)")
    build.set_defaults(func=cmd_banks_build)

    states = sub.add_parser("states", help="learners' and sessions' stored state")
    states_sub = states.add_subparsers(dest="states_command", required=True)
    migrate = states_sub.add_parser(
        "migrate", help="rebuild every entity's state for a version from its event log, before it becomes latest",
        description="Rebuild, from their event logs, the state every learner or session has for a model version, "
                    "so that no request waits for it once the version serves. Reads NEXTSTEP_* settings (the "
                    "service's Redis and artifacts directory). Safe while serving and from several processes; "
                    "stopped, it resumes from the last cursor printed (--cursor), or from the start at little "
                    "cost: entities already up to date are one read each.")
    migrate.add_argument("--model", required=True, help="the model's name")
    migrate.add_argument("--to", required=True, help="the version to bring up to date (its directory's name)")
    migrate.add_argument("--artifacts", help="artifacts directory (default: NEXTSTEP_ARTIFACTS_DIR)")
    migrate.add_argument("--rate", type=_above_zero, help="at most this many entities a second (default: as "
                                                              "fast as one process goes)")
    migrate.add_argument("--page", type=_int_in(1, 5000), default=500, help="entities per page (default 500)")
    migrate.add_argument("--cursor", default="0", help="resume from this cursor (a progress line's)")
    migrate.add_argument("--quiet", action="store_true", help="no progress lines")
    migrate.set_defaults(func=cmd_states_migrate)

    events = sub.add_parser("events", help="the event logs the service keeps")
    events_sub = events.add_subparsers(dest="events_command", required=True)
    export_ev = events_sub.add_parser(
        "export", help="write a model's event logs as training files (train and test, split by entity)",
        description="Write every learner's (or session's) logged events as the files `nextstep train` reads for "
                    "the model's family: the long CSV for knowledge tracing, GRU4Rec's TSV for sessions, the "
                    "review-log CSV of each flashcard user's stored reviews, gzipped, split into train and test by a "
                    "hash of the entity id. Reads NEXTSTEP_* settings.")
    export_ev.add_argument("--model", required=True, help="the model's name (its entities' logs are read)")
    export_ev.add_argument("--out", required=True, help="folder to write (files of an earlier export are refused)")
    export_ev.add_argument("--test-fraction", type=_fraction, default=0.2,
                           help="share of entities written to the test file (default 0.2; 0: all to train)")
    export_ev.add_argument("--task",
                           help="the model's task (default: read from its artifact)")
    export_ev.add_argument("--artifacts", help="artifacts directory (default: NEXTSTEP_ARTIFACTS_DIR)")
    export_ev.add_argument("--quiet", action="store_true", help="no progress lines")
    export_ev.set_defaults(func=cmd_events_export)

    for name in TASK_MODULES:  # each task's own commands (its package's commands.py, where it has one)
        if importlib.util.find_spec(f"{package(name)}.commands") is not None:
            importlib.import_module(f"{package(name)}.commands").add_commands(sub)

    retrain = sub.add_parser(
        "retrain", help="train a model's next version on its logged traffic and start it as a gated shadow",
        description="Export the model's logged traffic (NEXTSTEP_REDIS_URL), train its family with the settings of "
                    "the version serving (or tune them first), write the next version into the artifacts folder, "
                    "and with --url reload the service and start the new version as a shadow of every entity, gated "
                    "(knowledge tracing: the service promotes or aborts it on the evidence). Reads NEXTSTEP_* "
                    "settings.")
    retrain.add_argument("--model", required=True, help="the model to retrain (its traffic is exported)")
    retrain.add_argument("--artifacts", help="artifacts directory (default: NEXTSTEP_ARTIFACTS_DIR)")
    retrain.add_argument("--url", help="the service: reload it and start the new version as a gated shadow")
    retrain.add_argument("--api-key", help="an admin key of the service (X-API-Key; default: "
                                           "NEXTSTEP_RETRAIN_API_KEY, else the first of NEXTSTEP_ADMIN_KEYS)")
    retrain.add_argument("--tune", action="store_true", help="tune the settings first (nextstep tune)")
    retrain.add_argument("--tune-timeout", type=int, default=3600, help="seconds of tuning with --tune (3600)")
    retrain.add_argument("--keep-data", help="export the traffic into this folder and keep it (default: a temporary "
                                             "one)")
    retrain.add_argument("--json", help="also write the summary as JSON to this file")
    retrain.set_defaults(func=cmd_retrain)

    demo = sub.add_parser("demo", help="train small models on generated data and print predictions")
    demo.add_argument("--out", help="working directory (default: a temporary one)")
    demo.add_argument("--epochs", type=_int_in(1),
                      help="training epochs of each model that takes --epochs (default: its demo recipe's)")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_threads()  # (torch is imported by the commands, after this: nextstep/cpus.py)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback (train says what it left)
        print(f"nextstep {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except (OSError, ValueError) as exc:
        # files that are missing, unreadable or malformed, settings or data a model cannot take: the message names
        # the file, line or field; NEXTSTEP_TRACEBACK=1 shows where in the code it was raised
        if os.environ.get("NEXTSTEP_TRACEBACK", "").lower() in TRUE:
            raise
        raise SystemExit(f"nextstep {args.command}: {exc} (NEXTSTEP_TRACEBACK=1 shows where it was raised)") \
            from None


if __name__ == "__main__":
    sys.exit(main())
