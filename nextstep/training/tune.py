"""`nextstep tune`: a family's settings tuned on a new data set within a time budget (Optuna), then the model
trained with the best of them on the whole training file, evaluated once on the test file and exported.

    training file --carved--> fit part + validation part      the study: every trial fits on the first and is
                                                               scored on the second (the test file is never opened)
    best settings --> the family's own run (`nextstep train`): the whole training file, the test file read once

Validation, by task, only from the training data:
- knowledge tracing: 20% of the training learners (a seeded split, `split_students`), never fitted on;
- sessions: the official protocol's *_train_tr / *_train_valid where the data set has them, else the sessions
  starting in the last 10% of the training file's time span (of *_train_full, or of one file's training part);
- flashcards: the srs tuning split (srs/time_aware_run.py `tuning_split`: the second to fourth sixths of the
  reviews, each fitted on the reviews before it); the protocol's last two blocks are never looked at.

A study lives in an Optuna storage (SQLite in the artifact folder by default; any storage URL, so that processes
on many machines work on one study), named from the family, the data and the base config: run again, it goes on
where it stopped. Trial 0 is the base config (the family's defaults unless --config), so a tune never returns
settings worse on validation than the defaults. Each epoch's validation score goes to the pruner (median by
default), which stops trials that trail the others; the study's time limit also ends the running trials at
their next epoch (all but trial 0, which always finishes: without it there is nothing to compare with).
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import math
import multiprocessing
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .families import family, load
from .spaces import Space, apply

HOLDOUT = 0.2  # knowledge tracing: the share of training learners held out as the study's validation
SPLIT_SEED = 20_260_059  # that split's seed: the same in every trial, process and machine
# validation metrics where lower is better (every other one: higher)
LOWER = {"nll", "mae", "log_loss", "rmse_bins", "rating_ce", "duration_mae_s", "duration_rmse_s"}
DEFAULT_METRIC = {"knowledge_tracing": "auc", "next_item": "recall@20", "srs": "log_loss"}


class StudyTimeout(Exception):
    """A trial still running when the study's time is spent (it ends as pruned)."""


# ----------------------------------------------------------------------------- validation problems, by task


class KTProblem:
    """Knowledge tracing: the training file's learners, HOLDOUT of them held out (the test file is not opened)."""

    def __init__(self, entry, data, fmt: str | None = None, **_):
        from .kt.data import split_students

        self.entry, self.data = entry, Path(data)
        train, self.source = read_kt_train(self.data, fmt)
        self.fit_ds, self.valid_ds = split_students(train, HOLDOUT, SPLIT_SEED)
        self.n_cats = train.n_cats
        self.validation = (f"{len(self.valid_ds)} of the {len(train)} training sequences' learners ({HOLDOUT:.0%}, "
                           f"seeded) held out of {self.source}; the test file is not read")

    def default_metric(self) -> str:
        return "auc" if self.n_cats == 2 else "qwk"

    def run(self, cfg, metric: str, report: Callable[[int, float], None]) -> float:
        if self.entry.name == "simakt":
            return self._simakt(cfg, metric)
        import torch

        from .data import Vocabulary, hide_ids
        from .kt.data import split_students
        from .kt.loop import fit, predict_sequences
        from .kt.run import encode
        from .loop import epoch_hook

        read, batcher, loss, score = self.entry.parts()
        es_fit, es_valid = split_students(self.fit_ds, cfg.valid_fraction, cfg.seed)
        vocab = Vocabulary.build(np.concatenate([s.questions for s in es_fit.sequences]),
                                 min_count=cfg.min_question_count)
        fit_enc = encode(es_fit, vocab)
        fit_enc = list(zip(hide_ids([q for q, _ in fit_enc], cfg.unknown_share, cfg.seed), [r for _, r in fit_enc],
                           strict=True))
        valid_enc = encode(self.valid_ds, vocab)
        torch.manual_seed(cfg.seed)
        model = self.entry.build({"n_questions": len(vocab), "n_cats": self.n_cats, **cfg.model})
        warm_start = getattr(model, "warm_start", None)
        warm = warm_start(fit_enc) if warm_start is not None else None

        def measure(m) -> float:
            pred = predict_sequences(m, valid_enc, max_len=cfg.eval_max_len, batcher=batcher)
            return float(score(pred["probs"], pred["targets"])[metric])

        with epoch_hook(lambda epoch, m, row: report(epoch, measure(m))):
            fit(model, fit_enc, encode(es_valid, vocab), cfg, batcher=batcher, loss=loss, metrics=score,
                progress=False, log=False, validate_start=warm is not None)
        return measure(model)

    def _simakt(self, cfg, metric: str) -> float:
        from .kt.simakt_run import train_simakt

        manifest = train_simakt(self.data, None, cfg=cfg, name=self.entry.name, export=False, log=lambda *a: None,
                                datasets=(self.fit_ds, self.valid_ds))
        return float(manifest["metrics"]["test"][metric])


def read_kt_train(data: Path, fmt: str | None):
    """The training learners of a knowledge-tracing data set, read without opening its test file (one data file:
    its training part, as `load_dataset` splits it)."""
    from .kt import data as kt

    train_path, test_path, _ = kt._layout(data)
    if test_path is None:
        train, _ = kt.load_dataset(data, fmt)
        return train, f"{train.path}'s training learners"
    used = fmt or kt.detect_format(train_path)
    train = kt.READERS[used](train_path, **kt._reader_kwargs(data if data.is_dir() else data.parent, train_path,
                                                             used))
    if not train.sequences:
        raise kt.DataFormatError(train.path, 1, "at least one record", "an empty file")
    kt.check_not_one_row_per_learner(train)
    return train, train_path.name


class SessionProblem:
    """Sessions: the official protocol's train_tr / train_valid, or the last 10% of the training file's time."""

    def __init__(self, entry, data, fmt: str | None = None, **_):
        self.entry = entry
        self.train, self.valid, self.validation = read_session_tuning(Path(data), fmt)

    def default_metric(self) -> str:
        return "recall@20"

    def run(self, cfg, metric: str, report: Callable[[int, float], None]) -> float:
        from .data import Vocabulary, hide_ids
        from .loop import epoch_hook
        from .next_item.run import encode_eval

        read, _, _, score = self.entry.parts()
        vocab = Vocabulary.build(self.train.items, min_count=cfg.min_item_count)
        share = 0.0 if not self.entry.reads_clicks else cfg.unknown_share
        train_enc = self.train.encode(vocab, drop_unknown=False)
        train_enc.items = hide_ids([train_enc.items], share, cfg.seed)[0]
        valid_enc = encode_eval(self.valid, vocab, self.train.items)
        if not (valid_enc.lengths() > 1).any():
            raise ValueError(f"{self.validation}: no validation session has two clicks on training items")

        def measure(m) -> float:
            return float(score(m, valid_enc)[metric])

        with epoch_hook(lambda epoch, m, row: report(epoch, measure(m))):
            model, _ = self.entry.resolve("fit")(self.entry, cfg, train_enc, len(vocab), False, False)
        return measure(model)


def read_session_tuning(data: Path, fmt: str | None):
    """(fit sessions, validation sessions, what they are) of a session data set, never opening its *_test file."""
    from .next_item import sessions as s

    if data.is_dir():
        files = sorted(p for p in data.iterdir() if p.is_file() and not p.name.startswith("."))
        stems = [s._stem(p) for p in files]
        reader = s._reader(fmt or "gru4rec", {})
        if any(x.endswith("_train_tr") for x in stems) and any(x.endswith("_train_valid") for x in stems):
            tr, va = s._find(data, "_train_tr"), s._find(data, "_train_valid")
            return reader(tr), reader(va), f"{tr.name} (fit) and {va.name} (validation)"
        if any(x.endswith("_train_full") for x in stems):
            full = s._find(data, "_train_full")
            train, valid = s.split_by_time(reader(full), s.TEST_TIME_SHARE)
            return train, valid, (f"{full.name}: the sessions starting in the last {s.TEST_TIME_SHARE:.0%} of its "
                                  "time span (validation), the rest (fit)")
    train, valid = s.load_session_split(data, valid=True, fmt=fmt)
    return train, valid, train.notes.get("split", str(data))


class ReviewProblem:
    """Flashcards: the srs tuning split of the review log (`tuning_split`)."""

    def __init__(self, entry, data, fmt: str | None = None, day_columns: str = "check",
                 duration_cap_s: float | None = None, **_):
        from .srs.reviews import read_review_data

        self.entry = entry
        self.log = read_review_data(data, day_columns=day_columns, duration_cap_s=duration_cap_s)
        self.validation = (f"{self.log.path}: the srs tuning split (the 2nd to 4th sixths of the reviews, each "
                           "fitted on the reviews before it; the protocol's last two blocks are not looked at)")

    def default_metric(self) -> str:
        return "log_loss"

    def run(self, cfg, metric: str, report: Callable[[int, float], None]) -> float:
        from .loop import epoch_hook
        from .srs.time_aware_run import tuning_split

        with epoch_hook(lambda epoch, m, row: report(None, None)):  # only the study's time limit
            return float(tuning_split(self.log, cfg=cfg)[metric])


PROBLEMS = {"knowledge_tracing": KTProblem, "next_item": SessionProblem, "srs": ReviewProblem}


# ----------------------------------------------------------------------------- the study


def study_name(entry, data, base: dict, metric: str) -> str:
    """The study's name: the family, the data set and a hash of the base config and metric (a study is resumed
    only with the same ones: its parameters' choices come from the base config)."""
    digest = hashlib.sha1(json.dumps([base, metric], sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"{entry.name}-{Path(data).absolute().name}-{digest}"


def space_of(entry, cfg) -> Space:
    return (load(entry.space) if entry.space else Space(())).with_base(cfg)


def direction(metric: str) -> str:
    return "minimize" if metric in LOWER else "maximize"


def quiet_optuna() -> None:
    """Optuna's own log lines and its warnings about experimental arguments off: the progress says what happens."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


def make_storage(url: str):
    import optuna

    # heartbeats: a trial of a process that died (killed, a machine lost) is failed by the next process to start
    # one, rather than left running forever
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
    return optuna.storages.RDBStorage(url, heartbeat_interval=30, grace_period=120, engine_kwargs=kwargs)


def make_pruner(name: str):
    import optuna

    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1)
    if name == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=1)


def open_study(storage: str, name: str, metric: str, pruner: str, seed: int, defaults: dict | None = None):
    """Create or load the study; a new one gets trial 0, the defaults, first in its queue."""
    import optuna

    sampler = optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, constant_liar=True,
                                         n_startup_trials=8)
    study = optuna.create_study(storage=make_storage(storage), study_name=name, direction=direction(metric),
                                sampler=sampler, pruner=make_pruner(pruner), load_if_exists=True)
    if defaults is not None and not study.user_attrs.get("defaults_enqueued"):
        study.set_user_attr("defaults_enqueued", True)
        study.enqueue_trial(defaults, user_attrs={"defaults": True})
    return study


def finished(study) -> list:
    from optuna.trial import TrialState

    return [t for t in study.get_trials(deepcopy=False) if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]


def optimize(job: dict, worker: int = 0, progress: Callable | None = None, problem=None) -> None:
    """One process's share of the study: trials until the study's deadline, its trial count, or Ctrl-C
    (`problem`: the data already read, in the process that started the study)."""
    import optuna
    import torch
    from optuna.trial import TrialState

    quiet_optuna()
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    entry = family(job["family"])
    base = entry.read_train_config(None, None)
    base = apply(base, job["base"])
    if job.get("device"):
        base = apply(base, {"device": job["device"]})
    space = space_of(entry, base)
    problem = problem or PROBLEMS[entry.task](entry, job["data"], **job["options"])
    study = open_study(job["storage"], job["study"], job["metric"], job["pruner"], job["seed"] + worker)
    metric, deadline = job["metric"], job["deadline"]

    def objective(trial) -> float:
        overrides = space.suggest(trial)
        trial.set_user_attr("config", overrides)
        trial.set_user_attr("worker", f"{os.uname().nodename}:{os.getpid()}")
        cfg = apply(base, overrides)
        started = time.time()
        defaults = bool(trial.user_attrs.get("defaults"))

        def report(step, value) -> None:
            if value is not None:
                if not math.isfinite(value):
                    raise optuna.TrialPruned(f"validation {metric} is {value}")
                trial.report(value, step)
                if not defaults and trial.should_prune():  # the defaults are the score to beat: never pruned
                    raise optuna.TrialPruned(f"epoch {step}: validation {metric} {value:.4f} trails the others")
            if time.time() > deadline and not defaults:  # the defaults always finish: the score to beat
                trial.set_user_attr("stopped", "the study's time ran out")
                raise optuna.TrialPruned("the study's time ran out")

        try:
            value = problem.run(cfg, metric, report)
        except KeyError as exc:  # no trial can succeed: said at once, not after the study's time
            raise SystemExit(f"tune: --metric {metric}: not a validation metric of {entry.name} ({exc})") from None
        except (FloatingPointError, ValueError, RuntimeError) as exc:  # settings this data cannot take: a failed trial
            trial.set_user_attr("error", f"{type(exc).__name__}: {exc}"[:500])
            raise
        trial.set_user_attr("seconds", round(time.time() - started, 1))
        if not math.isfinite(value):
            trial.set_user_attr("error", f"validation {metric} is {value}")
        return value

    def stop_when_done(study, trial) -> None:
        n = len(finished(study))
        if progress is not None:
            progress(study, n)
        if job["trials"] is not None and n >= job["trials"] or time.time() >= deadline or space_empty:
            study.stop()

    space_empty = not space.params  # nothing to search: trial 0, the defaults, is the study
    if job["trials"] is not None and len(finished(study)) >= job["trials"] or space_empty and finished(study):
        return
    catch = (FloatingPointError, ValueError, RuntimeError)
    if study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):  # the defaults: run whatever the time
        study.optimize(objective, n_trials=1, callbacks=[stop_when_done], catch=catch, gc_after_trial=True)
    left = deadline - time.time()
    if left > 0 and not space_empty and (job["trials"] is None or len(finished(study)) < job["trials"]):
        study.optimize(objective, timeout=left, callbacks=[stop_when_done], catch=catch, gc_after_trial=True)


def _worker(job: dict, worker: int) -> None:
    # a spawned process: Ctrl-C reaches the whole process group; the parent reports it once
    with contextlib.suppress(KeyboardInterrupt):
        optimize(job, worker)


def run_study(entry, data, out: Path, *, base: dict | None = None, timeout: float = 3600.0,
              trials: int | None = None, storage: str | None = None, jobs: int = 1, seed: int = 0,
              metric: str | None = None, pruner: str = "median", device: str | None = None,
              progress: bool = True, options: dict | None = None) -> dict:
    """Run (or resume) the study of `entry` on `data`; returns what the artifact's manifest records of it
    (`summary`) once the time, the trials or Ctrl-C end it. The test file is never opened here."""
    import optuna
    from optuna.trial import TrialState

    quiet_optuna()
    entry = family(entry)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    storage = storage or f"sqlite:///{(out / 'study.db').absolute()}"
    base = base or {}
    cfg = apply(entry.read_train_config(None, None), base)
    options = options or {}
    problem = PROBLEMS[entry.task](entry, data, **options)  # read once here: a data error before any process starts
    metric = metric or problem.default_metric()
    space = space_of(entry, cfg)
    name = study_name(entry, data, base, metric)
    started = time.time()
    threads = max(1, int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1) // jobs)
    job = {"family": entry.name, "data": str(data), "base": base, "storage": storage, "study": name,
           "metric": metric, "pruner": pruner, "seed": seed, "trials": trials, "deadline": started + timeout,
           "options": options, "device": device, "threads": threads}
    study = open_study(storage, name, metric, pruner, seed, defaults=space.defaults())
    study.set_user_attr("family", entry.name)
    study.set_user_attr("metric", metric)
    study.set_user_attr("validation", problem.validation)
    done_before = len(finished(study))
    total_before = sum(t.state != TrialState.WAITING for t in study.get_trials(deepcopy=False))
    bar = Progress(trials, started + timeout, metric, progress, done_before)
    processes = []
    try:
        if jobs > 1:
            context = multiprocessing.get_context("spawn")
            processes = [context.Process(target=_worker, args=(job, k), daemon=False) for k in range(1, jobs)]
            for p in processes:
                p.start()
        optimize(job, 0, progress=bar.update, problem=problem)
        for p in processes:
            p.join()
    except KeyboardInterrupt:
        for p in processes:
            p.join(timeout=30)
        raise
    finally:
        bar.close()
    study = optuna.load_study(study_name=name, storage=make_storage(storage))
    return summarize(study, space, metric, problem.validation, storage, time.time() - started, total_before)


class Progress:
    """Trials done, the best score so far and the time left: a bar on a terminal, else a line per trial."""

    def __init__(self, total: int | None, deadline: float, metric: str, show: bool, done: int):
        from tqdm import tqdm

        self.deadline, self.metric, self.show = deadline, metric, show
        self.bar = tqdm(total=total, initial=done, desc="tune", unit="trial", file=sys.stderr) \
            if show and sys.stderr.isatty() else None

    def update(self, study, n: int) -> None:
        from .loop import duration

        try:
            best = f"best {self.metric} {study.best_value:.4f} (trial {study.best_trial.number})"
        except ValueError:
            best = "no trial complete yet"
        left = f"{duration(max(self.deadline - time.time(), 0))} left"
        if self.bar is not None:
            self.bar.n = n
            self.bar.set_postfix_str(f"{best}, {left}")
        elif self.show:
            print(f"tune: {n} trials done; {best}; {left}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def summarize(study, space: Space, metric: str, validation: str, storage: str, seconds: float,
              before: int = 0) -> dict:
    """What the manifest records of a study: its best and default trials, counts, time."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None
                and math.isfinite(t.value)]
    if not complete:
        errors = [t.user_attrs["error"] for t in trials if "error" in t.user_attrs]
        raise ValueError(f"the study {study.study_name} has no complete trial yet"
                         + (f"; a trial failed with {errors[0]}" if errors else "; give it more --timeout"))
    best = study.best_trial
    defaults = next((t for t in trials if t.user_attrs.get("defaults")), None)
    counts = {state.name.lower(): sum(t.state == state for t in trials)
              for state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL, TrialState.RUNNING)}
    return {
        "study": study.study_name, "storage": _public(storage), "metric": metric,
        "direction": study.direction.name.lower(), "validation": validation,
        "best": {"trial": best.number, "value": best.value, "params": best.params,
                 "config": best.user_attrs.get("config", {})},
        "defaults": {"trial": defaults.number if defaults else None,
                     "value": defaults.value if defaults is not None and defaults.state == TrialState.COMPLETE
                     else None,
                     "state": defaults.state.name.lower() if defaults else None,
                     "params": space.defaults()},
        "trials": {**counts, "total": len(trials), "this_run": len(trials) - before},
        "seconds": round(seconds, 1),
        "space": [p.name for p in space.params],
    }


def _public(url: str) -> str:
    """A storage URL without its password."""
    if "://" in url and "@" in url.split("://", 1)[1]:
        scheme, rest = url.split("://", 1)
        user, _, host = rest.rpartition("@")
        return f"{scheme}://{user.split(':')[0]}:***@{host}"
    return url


# ----------------------------------------------------------------------------- what a study leaves beside the model


def write_trials_csv(study, path: Path) -> Path:
    """One row per trial: number, state, value, seconds, whether it was the defaults, then its parameters."""
    trials = study.get_trials(deepcopy=False)
    names = sorted({n for t in trials for n in t.params})
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["number", "state", "value", "seconds", "defaults", "last_step", *names, "note"])
        for t in trials:
            seconds = (t.datetime_complete - t.datetime_start).total_seconds() \
                if t.datetime_complete and t.datetime_start else None
            note = t.user_attrs.get("error") or t.user_attrs.get("stopped") or ""
            writer.writerow([t.number, t.state.name.lower(), t.value, None if seconds is None else round(seconds, 1),
                             bool(t.user_attrs.get("defaults")), t.last_step,
                             *[t.params.get(n) for n in names], note])
    return path


def write_report(study, path: Path, summary: dict, test: dict | None = None) -> Path:
    """An HTML page of Optuna's plots (history, parameter importances, slices, intermediate values), plotly.js
    embedded once so that it opens offline."""
    from optuna import visualization as vis

    figures, notes = [], []
    warnings.filterwarnings("ignore", module="optuna")  # importances of few trials: said in the plot's own title
    for title, plot in (("Optimization history", vis.plot_optimization_history),
                        ("Parameter importances", vis.plot_param_importances),
                        ("Slices: the score against each parameter", vis.plot_slice),
                        ("Per-epoch validation (what the pruner saw)", vis.plot_intermediate_values)):
        try:
            figures.append((title, plot(study)))
        except (ValueError, RuntimeError, ZeroDivisionError) as exc:  # e.g. importances of fewer than 2 trials
            notes.append(f"{title}: not drawn ({exc})")
    parts = []
    for i, (title, fig) in enumerate(figures):
        parts.append(f"<h2>{title}</h2>" + fig.to_html(full_html=False, include_plotlyjs=i == 0))
    best, defaults, trials = summary["best"], summary["defaults"], summary["trials"]

    def fmt(v):
        return "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)

    rows = "".join(f"<tr><td>{k}</td><td>{fmt(best['params'].get(k))}</td><td>{fmt(defaults['params'].get(k))}</td>"
                   f"</tr>" for k in sorted(set(best["params"]) | set(defaults["params"])))
    test_line = "" if not test else "<p>Test (read once, by the final model): " + ", ".join(
        f"{k} {fmt(v)}" for k, v in test.items() if isinstance(v, float)) + "</p>"
    html = f"""<!DOCTYPE html><html><head><meta charset="utf-8"><title>{summary['study']}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:auto}}td,th{{padding:2px 10px}}</style></head><body>
<h1>Study {summary['study']}</h1>
<p>Validation: {summary['validation']}. Metric: {summary['metric']} ({summary['direction']}).</p>
<p>Defaults (trial {defaults['trial']}): {fmt(defaults['value'])}; best (trial {best['trial']}): {fmt(best['value'])}.
Trials: {trials['complete']} complete, {trials['pruned']} pruned, {trials['fail']} failed; {summary['seconds']} s in
this run.</p>{test_line}
<table><tr><th>parameter</th><th>best</th><th>defaults</th></tr>{rows}</table>
{''.join(f'<p>{n}</p>' for n in notes)}
{''.join(parts)}
</body></html>
"""
    path.write_text(html)
    return path
