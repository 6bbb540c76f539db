"""The gate's error rates on real held-out entities (issue 60, part 2): how often a gated shadow decides, and how,
when the candidate is as good as the serving version, clearly better, or clearly worse; for knowledge tracing
(learners), sessions (next item) and flashcards (users).

    python bench/gate_error_rates.py --data ../shared/data/kt/dkvmn_assist2009_updated [--epochs 5] [--replays 200]
                                     [--work DIR] [--alpha 0.05] [--min-events 100] [--min-learners 30] [--iid]
    python bench/gate_error_rates.py --task sessions --data ../shared/data/rec/rsc15_100k [--work DIR] ...
    python bench/gate_error_rates.py --task srs --data ../shared/data/srs --min-learners 8 [--folds 4] [--block 200]
                                     [--srs-worse epoch|quarter] [--work DIR] ...

1. Three versions of each task, trained with `nextstep train` (with --work DIR they are kept there and reused by the
   next run, and so are the sessions' and flashcards' per-event losses, `losses-*.npz`: delete them to rescore):
   - kt (the default): deep_gpcm (configs/deep_gpcm_assistments09.json, --epochs, default 5): A on every training
     learner (seed 0), A' the same with seed 1 (equal quality, another seed), and B on every fifth training learner
     (clearly worse). Held out: the data set's test file.
   - sessions: gru4rec with its defaults (cross-entropy; --epochs, default the family's 10): A on `*_train_full`
     (seed 0), A' seed 1, B (seed 0) on every fifth training session (a copy of the data set under DIR/fifth, its
     training file reduced, its test file the same). Held out: the data set's test file; the entity is the session.
   - srs: time_aware with the training of bench/srs_user_folds.sh (cross_validate false, one thread, --epochs as
     its max_epochs cap, default 5), in folds over the sixteen users of ../shared/data/srs (that script's four
     balanced groups: --folds 4, each group held out once by a model of the twelve others; --folds 2, groups 1+2
     and 3+4, models of eight; --folds 1, group 1 only): A seed 0, A' seed 1, and B seed 0 capped at ONE epoch
     (meant to be clearly worse: the same users and settings, less trained; a quarter of the training users makes
     B's quality hang on which users fall in the quarter, AnkiMath alone being half the reviews). `--srs-worse
     quarter`: B (seed 0, --epochs) on every fourth training user in name order instead (DIR/.../train-quarter).
     Neither is much worse (docs/results.md): the served P(recall) is anchored on FSRS-6 and mixed with its
     defaults by each user's evidence. Held out: each fold's users; the entity is the user (with --block N, see 3).
2. Every held-out entity's events scored through each version by the service's own code, each event's forecast
   from the version's state before it, as a gated shadow pairs them:
   - kt: the exported graphs through nextstep.scoring.Scorer (`POST /v1/kt/{model}/batch`'s path); the loss of an
     event is its log loss (gate.log_losses).
   - sessions: each test session replayed from the initial state through the exported graphs by the service's own
     SessionRecommender._fold_scored (what a gated session shadow's follow_log and _pair run: each click after the
     session's first ranked in the top_k list (the manifest's, 100) the state before it recommends, over every item,
     ties against the model; a click not in the list has rank inf), clicks on items a version does not know stepped
     through its unknown row as the service's default (`unknown_items` "answer") does; the loss of a click is the
     gate's, sessions/service.py rank_loss: 1 - 1/rank (1 when not listed).
   - srs: `nextstep evaluate`'s forecasts (time_aware_run.score_on_users: per protocol fold, each user's FSRS-6
     parameters fitted by fsrs-rs on that user's training reviews of the fold, the drifts and the mixture's evidence
     run under them, the test block predicted; the served P(recall), the mixture); the events are the reviews the
     protocol scores (the test blocks' reviews of a card last seen on an earlier day), in time order; the loss of a
     review is the binary log loss of recall (y = rating > 1), as live quality and a flashcard gate score it
     (gate.log_losses of (1 - p, p), srs/shadow.py), each user's mean checked against `nextstep evaluate`'s.
3. Per scenario (serving, candidate): the paired differences, loss(candidate) - loss(serving), per entity; each
   replay puts the entities in a random order and feeds their events one by one to the gate's own arithmetic
   (nextstep.service.gate: the confidence sequence with learner_spread, decide; vectorised here, the same formulas),
   stopping at the first decision, with at least --min-events events and --min-learners entities (clusters) before
   one. `--iid` uses the events' own spread instead, as if events were independent. `--block N` (srs) cuts each
   user's scored reviews into consecutive blocks of N, each its own cluster for the spread and for --min-learners
   (a finer cluster than the user), while a user's blocks stay together, in order, and share the null's sign. The
   shares of replays that decided each way, and the median number of events to a decision.

Scenarios: (a) null: A' against A with each entity's differences given a random sign in each replay (which version
is the candidate drawn per entity), so that the mean difference is exactly 0 while the real data's noise and each
entity's correlated events stay: any decision is an error (goal: at most alpha); (a') another seed, A' against A as
they are: equal settings, but not necessarily equal quality on this test file (its mean difference says); (b)
better, A against B serving: promoted (goal: at least 90%); (c) worse, B against A serving: aborted (goal: at least
90%).
"""

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from nextstep.scoring import Scorer, ScoringError
from nextstep.service.gate import OPTIMIZED_AT, Evidence, GateConfig, decide, learner_spread, log_losses
from nextstep.service.kt.service import Event

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "deep_gpcm_assistments09.json"
TASKS = ("kt", "sessions", "srs")
VERSIONS = (("A", "A"), ("A'", "A2"), ("B", "B"))  # (name, folder under --work)
SRS_GROUPS = (  # bench/srs_user_folds.sh's FOLDS: balanced by reviews, each holds one of the four largest users
    ("ankimath", "anki_more/tkilb_ebrain-tech", "anki_small/Peregrine42_anki-flashcards",
     "anki_more/khanhtranngoccva_MyAnkiFlashcards"),
    ("py_fsrs_josh", "anki_more/ASproson_anki", "anki_small/hbnordin2_anki_cards", "anki_more/tobenwarrior_Anki2"),
    ("anki_more/tooyond_anki_zikao", "anki_more/CasioWave_AnkiCollection", "anki_small/maxproft_Anki",
     "anki_more/Machtan_anki-flashcards"),
    ("anki_more/gmprojects-ctrl_myanki", "anki_more/TonioBanderas_Binga", "anki_more/superdrdood_kanji",
     "anki_small/yourchocobro_Anki-Collection-Dump"),
)
SRS_FOLDS = {4: ((0,), (1,), (2,), (3,)), 2: ((0, 1), (2, 3)), 1: ((0,),)}  # the groups each fold holds out

Scored = dict[str, dict[str, np.ndarray]]  # version -> entity -> its events' losses, in order


def nextstep(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "nextstep.cli", *args], check=True)


def cached(path: Path, compute) -> dict[str, np.ndarray]:
    """`compute()` (entity -> losses), kept in `path` (npz) and read from there by the next run."""
    if path.is_file():
        with np.load(path) as f:
            return {k: f[k] for k in f.files}
    out = compute()
    np.savez(path, **out)
    return out


# -- knowledge tracing ----------------------------------------------------------------------------------------------

def three_line(path: Path) -> list[list[str]]:
    """The records of a DKVMN three-line file: [count, questions, responses] per learner, as text lines."""
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    return [lines[i:i + 3] for i in range(0, len(lines) - len(lines) % 3, 3)]


def fifth(data: Path, out: Path) -> Path:
    """A copy of the data set whose training file keeps every fifth learner."""
    out.mkdir(parents=True, exist_ok=True)
    for path in data.iterdir():
        if "train" in path.name:
            kept = three_line(path)[::5]
            (out / path.name).write_text("".join("\n".join(r) + "\n" for r in kept))
        elif "valid" not in path.name:
            (out / path.name).write_bytes(path.read_bytes())
    return out


def train(data: Path, out: Path, seed: int, epochs: int) -> Path:
    if not (out / "manifest.json").is_file():
        nextstep("train", "deep_gpcm", "--data", str(data), "--out", str(out), "--config", str(CONFIG), "--epochs",
                 str(epochs), "--seed", str(seed), "--quiet")
    return out


def losses(artifact: Path, learners: list[tuple[str, list[Event]]]) -> dict[str, np.ndarray]:
    """Each learner's per-event log loss through the version, each event predicted from the state before it."""
    scorer = Scorer.open(artifact)
    out = {}
    try:
        for student, events in learners:
            try:
                scored = scorer.score((student, events, None))
            except ScoringError:
                continue
            probs = np.array([p["probabilities"] for p in scored["event_predictions"]])
            out[student] = log_losses(probs, np.array([e.response for e in events]))
    finally:
        scorer.close()
    return out


def kt(args, work: Path) -> tuple[Scored, dict]:
    data, epochs = Path(args.data), args.epochs or 5
    versions = {"A": train(data, work / "A", 0, epochs), "A'": train(data, work / "A2", 1, epochs),
                "B": train(fifth(data, work / "fifth"), work / "B", 0, epochs)}
    (test,) = [p for p in data.iterdir() if "test" in p.name]
    learners = [(f"test-{i}", [Event(q, int(r)) for q, r in zip(rec[1].split(","), rec[2].split(","), strict=True)
                               if q])
                for i, rec in enumerate(three_line(test))]
    return {name: losses(path, learners) for name, path in versions.items()}, {}


# -- sessions -------------------------------------------------------------------------------------------------------

def fifth_sessions(data: Path, out: Path) -> Path:
    """A copy of a GRU4Rec-layout data set whose `*_train_full` file keeps every fifth session (in the reader's
    order, by first click) and whose `*_test` file is the same."""
    from nextstep.training.next_item.sessions import _find, read_gru4rec_tsv, subset, write_gru4rec_tsv

    out.mkdir(parents=True, exist_ok=True)
    train_file, test_file = _find(data, "_train_full"), _find(data, "_test")
    if not (out / train_file.name).is_file():
        sessions = read_gru4rec_tsv(train_file)
        write_gru4rec_tsv(subset(sessions, np.arange(0, len(sessions), 5)), out / ".partial")
        (out / ".partial").rename(out / train_file.name)
    (out / test_file.name).write_bytes(test_file.read_bytes())
    return out


def train_sessions(data: Path, out: Path, seed: int, epochs: int | None) -> Path:
    if not (out / "manifest.json").is_file():
        nextstep("train", "gru4rec", "--data", str(data), "--out", str(out), "--seed", str(seed), "--quiet",
                 *(["--epochs", str(epochs)] if epochs else []))
    return out


def session_losses(artifact: Path, sessions: list[tuple[str, list[str]]]) -> dict[str, np.ndarray]:
    """Each session's per-click rank loss through the version (every click after the first), by the service's own
    SessionRecommender._fold_scored from the initial state, as a gated shadow ranks a turn's clicks."""
    from nextstep.service.memory_store import InProcessStore
    from nextstep.service.registry import load_artifact
    from nextstep.service.runtime import Engines
    from nextstep.service.sessions.service import Click, SessionRecommender, rank_loss

    model = load_artifact(artifact, intra_op_threads=1)
    engines = Engines(max_batch=1, max_wait_ms=0)
    service = SessionRecommender(None, InProcessStore(ttl_seconds=None), engines)
    # (follow_log's and _pair's: the unknown row where the setting, "answer" by default, and the version allow)
    mode = "answer" if service.unknown_items == "answer" and model.unknown_row else "skip"

    async def run() -> dict[str, np.ndarray]:
        out = {}
        try:
            for session, items in sessions:
                rows = [r for r in service._rows(model, [Click(i) for i in items], mode, "") if r is not None]
                if len(rows) < 2:
                    continue
                _, _, ranks = await service._fold_scored(model, model.initial_state, False, rows, None,
                                                         keep_state=False)
                out[session] = rank_loss(ranks)
        finally:
            await engines.close()
        return out

    return asyncio.run(run())


def sessions(args, work: Path) -> tuple[Scored, dict]:
    from nextstep.training.next_item.sessions import _find, read_gru4rec_tsv

    data = Path(args.data)
    versions = {"A": train_sessions(data, work / "A", 0, args.epochs),
                "A'": train_sessions(data, work / "A2", 1, args.epochs),
                "B": train_sessions(fifth_sessions(data, work / "fifth"), work / "B", 0, args.epochs)}
    test = read_gru4rec_tsv(_find(data, "_test"))
    held_out = [(name, [str(i) for i in test.session(s)]) for s, name in enumerate(test.session_ids)]
    scored = {name: cached(work / f"losses-{folder}.npz", lambda path=versions[name]: session_losses(path, held_out))
              for name, folder in VERSIONS}
    mrr = {name: float(np.mean([1 - x for v in s.values() for x in v])) for name, s in scored.items()}
    return scored, {"loss": "1 - 1/rank of the clicked item in the top-100 list recommended before it (1: not "
                            "listed)", "mrr@100": mrr}


# -- flashcards -----------------------------------------------------------------------------------------------------

def srs_folds(data: Path, work: Path, n_folds: int) -> list[Path]:
    """The folds' folders under `work`: each with train/ and test/ holding links to its users' folders."""
    folds = []
    for k, held in enumerate(SRS_FOLDS[n_folds], start=1):
        fold = work / f"folds{n_folds}" / f"f{k}"
        for g, users in enumerate(SRS_GROUPS):
            side = fold / ("test" if g in held else "train")
            side.mkdir(parents=True, exist_ok=True)
            for user in users:
                link = side / Path(user).name
                if not link.is_symlink():
                    link.symlink_to(data / user)
        folds.append(fold)
    return folds


def quarter(train: Path, out: Path) -> Path:
    """A folder of links to every fourth of the users in `train` (in name order)."""
    out.mkdir(parents=True, exist_ok=True)
    for user in sorted(train.iterdir())[::4]:
        if not (out / user.name).is_symlink():
            (out / user.name).symlink_to(user.resolve())
    return out


def train_srs(data: Path, out: Path, seed: int, max_epochs: int) -> Path:
    if not (out / "manifest.json").is_file():
        config = out.parent / f"{out.name}.json"
        config.write_text(json.dumps({"cross_validate": False, "max_epochs": max_epochs, "seed": seed,
                                      "threads": 1}) + "\n")
        nextstep("train", "time_aware", "--data", str(data), "--out", str(out), "--config", str(config), "--quiet")
    return out


def srs_losses(artifact: Path, base) -> dict[str, np.ndarray]:
    """Each held-out user's per-review log loss of recall through the version on the reviews the protocol scores,
    in time order: `nextstep evaluate`'s forecasts (score_on_users' loop), checked against its per-user log loss."""
    from nextstep.service.quality import event_scores
    from nextstep.training.srs.eval import evaluate_predictions, scored_mask, user_index
    from nextstep.training.srs.time_aware_loop import ReviewTensors, predict
    from nextstep.training.srs.time_aware_run import load_time_aware

    model, _ = load_time_aware(artifact)
    log = base.log
    rt = ReviewTensors(log, model.cfg.window, model.cfg.card_window, model.cfg.day_start_hour)
    p_recall = np.full(len(log), np.nan)
    for k, (_, test) in enumerate(base.folds):  # (score_on_users', as `nextstep evaluate` runs it)
        per_user = np.tile(np.asarray(base.default_w), (log.n_users, 1))
        for (fold, u), w in base.fitted.parameters.items():
            if fold == k:
                per_user[u] = w
        rt.set_params(per_user)
        rt.set_drift(model)
        rt.set_evidence(model)
        rows = np.sort(test)
        p_recall[rows] = predict(model, rt, rows)["recall"]
    rows = np.sort(np.concatenate([te for _, te in base.folds]))
    rows = rows[scored_mask(log)[rows]]
    y = (np.asarray(log.rating)[rows] > 1).astype(np.int64)
    p = p_recall[rows]
    probs = np.stack([1 - p, p], axis=1)
    loss = log_losses(probs, y)  # (the gate's, srs/shadow.py's: P clipped to [1e-7, 1]; live quality's 1e-12)
    quality = event_scores(probs, y)["log_loss"]
    if (loss != quality).any():
        print(f"{artifact}: {int((loss != quality).sum())} reviews' losses clipped by the gate", file=sys.stderr)
    users = user_index(log)
    owner = users[rows]
    out = {}
    for u, user in enumerate(log.user_ids):
        mine = owner == u
        if not mine.any():
            continue
        out[user] = loss[mine]
        folds = [(tr[users[tr] == u], te[users[te] == u]) for tr, te in base.folds]
        expected = evaluate_predictions(log, folds, p_recall)["log_loss"]
        if abs(expected - quality[mine].mean()) > 1e-9:
            raise AssertionError(f"{artifact}: {user}'s log loss {quality[mine].mean()} is not the evaluation's "
                                 f"{expected}")
    return out


def srs(args, work: Path) -> tuple[Scored, dict]:
    import torch

    from nextstep.training.srs.reviews import read_review_data
    from nextstep.training.srs.time_aware_run import ProtocolBaselines

    torch.set_num_threads(1)
    epochs = args.epochs or 5
    worse = {"epoch": ("B", 1), "quarter": ("Bq", epochs)}[args.srs_worse]  # (B's folder, max_epochs)
    folders = {"A": "A", "A'": "A2", "B": worse[0]}
    scored: Scored = {name: {} for name in folders}
    for fold in srs_folds(Path(args.data).resolve(), work, args.folds):
        b_data = fold / "train" if args.srs_worse == "epoch" else quarter(fold / "train", fold / "train-quarter")
        versions = {"A": train_srs(fold / "train", fold / "A", 0, epochs),
                    "A'": train_srs(fold / "train", fold / "A2", 1, epochs),
                    "B": train_srs(b_data, fold / worse[0], 0, worse[1])}
        base = None  # (the protocol's folds and fsrs-rs's fits of the fold's users: once, and only to score)
        for name, folder in folders.items():
            path = fold / f"losses-{folder}.npz"
            if base is None and not path.is_file():
                base = ProtocolBaselines(read_review_data(fold / "test"))
            scored[name].update(cached(path, lambda artifact=versions[name], b=base: srs_losses(artifact, b)))
    return scored, {"loss": "binary log loss of recall (rating > 1) on the reviews the protocol scores",
                    "folds": args.folds, "B": {"epoch": "the training users, at most 1 epoch",
                                               "quarter": "every fourth training user (in name order)"}[
                                                   args.srs_worse],
                    "max_epochs": {"A": epochs, "A'": epochs, "B": worse[1]}}


# -- the replays ----------------------------------------------------------------------------------------------------

def replay(per_learner: list[np.ndarray], config: GateConfig, replays: int, seed: int, flip: bool = False,
           iid: bool = False, groups: list[list[int]] | None = None) -> list[tuple[str, int]]:
    """(the first decision, the events it took; "continue" and the events in all when none) of each replay. With
    `flip`, each learner's differences change sign at random in each replay (which version is the candidate, drawn
    per learner): a mean of exactly 0, each learner's own correlations kept. `groups` (default: each learner its
    own): the learners (clusters) that come together, in their order, and share a sign (a user's blocks)."""
    rng = np.random.default_rng(seed)
    groups = groups or [[i] for i in range(len(per_learner))]
    out = []
    for _ in range(replays):
        order = rng.permutation(len(groups))
        signs = rng.choice([-1.0, 1.0], size=len(groups)) if flip else np.ones(len(groups))
        parts = [signs[g] * per_learner[i] for g in order for i in groups[g]]
        d = np.concatenate(parts)
        n = np.arange(1, len(d) + 1)
        mean = np.cumsum(d) / n
        # the gate's learner_spread after each event: sums over the learners so far (the current one partly seen)
        lengths = np.array([len(p) for p in parts])
        owner = np.repeat(np.arange(len(parts)), lengths)
        start = np.repeat(np.cumsum(lengths) - lengths, lengths)
        within_s = np.cumsum(d) - np.concatenate([[0.0], np.cumsum(d)])[start]  # the current learner's S so far
        within_n = (n - start).astype(float)
        totals = np.array([p.sum() for p in parts])
        ss_done = np.concatenate([[0.0], np.cumsum(totals ** 2)])[owner]
        ns_done = np.concatenate([[0.0], np.cumsum(lengths * totals)])[owner]
        nn_done = np.concatenate([[0.0], np.cumsum(lengths.astype(float) ** 2)])[owner]
        spread = learner_spread(mean, ss_done + within_s ** 2, ns_done + within_n * within_s,
                                nn_done + within_n ** 2)
        if iid:  # (the paper's: n times the events' variance)
            spread = n * np.maximum(np.cumsum(d * d) / n - mean ** 2, 0)
        alpha = config.alpha
        r2 = (-2 * np.log(alpha) + np.log(1 - 2 * np.log(alpha))) / OPTIMIZED_AT
        inner = np.maximum(spread, 0) * r2 + 1
        radius = np.sqrt(2 * inner / (n ** 2 * r2) * np.log(np.sqrt(inner) / alpha))
        low, high = mean - radius, mean + radius
        ready = (n >= config.min_events) & (owner >= config.min_learners - 1)
        decided = ready & ((high < -config.min_gain) | (low > 0))
        if not decided.any():
            out.append(("continue", len(d)))
            continue
        t = int(np.argmax(decided))
        # (the gate's own decision at that event, from its own arithmetic: the vectorised sums above agree with it)
        out.append((decide(Evidence(t + 1, float(mean[t]), (float(low[t]), float(high[t])), int(owner[t]) + 1),
                           config), t + 1))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=TASKS, default="kt", help="kt (the default), sessions or srs")
    parser.add_argument("--data", required=True, help="kt: a DKVMN three-line data set (e.g. "
                        "dkvmn_assist2009_updated); sessions: a GRU4Rec-layout data set (rsc15_100k); srs: the "
                        "folder of the sixteen users (../shared/data/srs)")
    parser.add_argument("--epochs", type=int, help="kt: 5 by default; sessions: the family's (10); srs: the "
                        "max_epochs cap of A and A' (5; B's is 1, or this with --srs-worse quarter)")
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--min-events", type=int, default=100)
    parser.add_argument("--min-learners", type=int, default=GateConfig.min_learners,
                        help="entities (clusters) before a decision (the gate's default 30; srs has 15 scored users)")
    parser.add_argument("--folds", type=int, choices=sorted(SRS_FOLDS), default=4, help="srs: folds over the users")
    parser.add_argument("--srs-worse", choices=["epoch", "quarter"], default="epoch",
                        help="srs: B on the training users at most one epoch, or on every fourth of them")
    parser.add_argument("--block", type=int, help="srs: clusters of this many consecutive scored reviews of a user "
                        "(the null's sign and the order stay per user)")
    parser.add_argument("--work", help="keep the trained versions (and sessions' and srs' losses) here, and reuse")
    parser.add_argument("--iid", action="store_true", help="the events' own spread, as if independent (the paper's)")
    parser.add_argument("--json", help="write the results as JSON")
    args = parser.parse_args()
    if args.block is not None and args.block < 1:
        parser.error("--block must be at least 1")
    work = Path(args.work or tempfile.mkdtemp(prefix="gate-error-rates-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    scored, info = {"kt": kt, "sessions": sessions, "srs": srs}[args.task](args, work)
    prepared = time.perf_counter() - started
    common = sorted(set.intersection(*(set(s) for s in scored.values())))
    # (a pair exists only where both versions took the same events: a session whose clicks one version skips has none)
    common = [e for e in common if len({len(s[e]) for s in scored.values()}) == 1]
    clusters: list[tuple[str, slice]] = [(e, slice(None)) for e in common]
    groups = None
    if args.block:
        clusters, groups = [], []
        for e in common:
            n = len(scored["A"][e])
            groups.append(list(range(len(clusters), len(clusters) + -(-n // args.block))))
            clusters += [(e, slice(lo, lo + args.block)) for lo in range(0, n, args.block)]
    config = GateConfig(alpha=args.alpha, min_events=args.min_events, min_learners=args.min_learners)
    entity = {"kt": "learners", "sessions": "sessions", "srs": "users"}[args.task]
    loss = "mean_rank_loss" if args.task == "sessions" else "mean_log_loss"
    results = {entity: len(common), "events": int(sum(len(scored["A"][s]) for s in common)),
               loss: {k: float(np.concatenate([v[s] for s in common]).mean()) for k, v in scored.items()}}
    if args.task != "kt":
        results = {"task": args.task, **results, **info,
                   "gate": {"alpha": args.alpha, "min_events": args.min_events, "min_learners": args.min_learners,
                            "variance": "events as if independent (--iid)" if args.iid else "learner_spread"},
                   "clusters": len(clusters), "block": args.block}
    results["scenarios"] = {}
    for label, serving, candidate, want in (("null", "A", "A'", None), ("another seed", "A", "A'", None),
                                            ("better", "B", "A", "promote"), ("worse", "A", "B", "abort")):
        diffs = [scored[candidate][e][part] - scored[serving][e][part] for e, part in clusters]
        got = replay(diffs, config, args.replays, seed=len(label), flip=label == "null", iid=args.iid,
                     groups=groups)
        decisions = [d for d, _ in got]
        to_decide = [t for d, t in got if d != "continue"]
        results["scenarios"][label] = {
            "serving": serving, "candidate": candidate,
            "mean_difference": float(np.concatenate(diffs).mean()),
            "shares": {d: decisions.count(d) / len(got) for d in ("promote", "abort", "continue")},
            "median_events_to_decision": statistics.median(to_decide) if to_decide else None,
            "goal": ("any decision at most alpha" if label == "null" else "as its mean difference says")
            if want is None else f"{want} in at least 90%"}
        if args.task != "kt" and label != "null":
            per_entity = [float((scored[candidate][e] - scored[serving][e]).mean()) for e in common]
            results["scenarios"][label]["entities_where_candidate_better"] = int(sum(x < 0 for x in per_entity))
    if args.task != "kt":
        results["seconds"] = {"train_and_score": round(prepared, 1),
                              "replays": round(time.perf_counter() - started - prepared, 1)}
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
