"""SimAKT end to end: read a data set directory, train with memory banks, evaluate on its test file, export.

    train file --split by student--> fit students (in folds) + validation students (early stopping)
    test file  --------------------> metrics.test (auc, accuracy, nll): never used to choose anything

Training cuts sequences into chunks of the window; validation and test score whole sequences under the window
rule the service answers by (`predict`: SimAKT.chunked).

Banks during training are cross-fitted: the fit students are split into folds (`bank_folds`, 5 by default),
the banks are rebuilt from the current encoder at every epoch, one per fold from the students of
the other folds, and a batch of one fold reads its fold's banks, so no student ever sees a bank that holds
their own trajectory (their own future). Validation uses a bank of all fit
students. After training, the final banks come from every training-file student (fit and validation: all
training data, no test student), exactly what `nextstep banks build` makes, and the test metrics use them.
"""

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ...models.simakt import ConfigError, SimAKT, SimAKTConfig, contrastive_loss, parse_similarity, regularisation
from ..data import MIN_COUNT, UNKNOWN_SHARE, Vocabulary, check_unknown_options, fingerprint, hide_ids, unknown_record
from ..loop import describe, print_line, train_epochs  # batches: padded, length-sorted, shuffled by rng
from ..metrics import ordinal_metrics
from .banks import (
    Bank,
    build_banks,
    encode_readouts,
    encode_trajectories,
    load_banks,
    provenance,
    save_banks,
    select_answer_banks,
    select_banks,
)
from .data import READERS, KTDataset, find_split_files, load_dataset, split_students
from .loop import batches
from .simakt_export import export_simakt, load_simakt

Trajectory = tuple[np.ndarray, np.ndarray]  # (question rows, responses)


@dataclass
class SimAKTTrainConfig:
    epochs: int = 40  # upper bound; early stopping or the time budget usually ends sooner
    batch_size: int = 32
    lr: float = 1e-3
    problem_l2: float = 1e-5  # DTransformer's L2 on problem difficulties (sum of squares)
    lambda_cl: float = 0.0  # DTransformer's contrastive loss weight (0.1 there); off: it triples the step cost
    grad_clip: float = 10.0
    patience: int = 4  # epochs without a better validation AUC
    valid_fraction: float = 0.1
    max_minutes: float = 27.0  # stop starting epochs after this (one run must fit in 30 min on 2 cores)
    bank_folds: int = 5  # training banks are cross-fitted: a student's batch reads the banks of the other folds
    # (80% of the fit students; halves gave the peers head half the evidence it answers with, docs/decisions.md)
    refit_answer_heads: bool = True  # refit answer heads' output maps on the validation students where a
    # cross-fitted estimate on them says it pays (refit_answer_heads below; docs/decisions.md)
    seed: int = 0
    device: str = "cpu"  # "cuda" for sweeps on a GPU; every reported figure is a CPU run
    model: dict = field(default_factory=dict)  # SimAKTConfig overrides (d_model, n_know, dropout, window, ...)
    # the unknown row, as the other knowledge-tracing families (loop.TrainConfig): skills (and problem-skill pairs)
    # seen fewer times share it or their skill's row; a seeded share of the fitting interactions goes through it
    min_question_count: int = MIN_COUNT
    unknown_share: float = UNKNOWN_SHARE

    def __post_init__(self):
        check_unknown_options(self.min_question_count, self.unknown_share)


def load_similarity(path: str | Path | None) -> dict:
    """A similarity configuration from a JSON or YAML file. FILE#name picks one named configuration from a
    file of several (the seed's {"similarity_approaches": {name: {...}}} layout)."""
    if path is None:
        return {}
    path, _, name = str(path).partition("#")
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml
        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if name:
        collection = next((v for v in data.values() if isinstance(v, dict) and name in v), None) \
            if isinstance(data, dict) else None
        if collection is None:
            raise ValueError(f"{path}: no configuration named {name!r}")
        data = collection[name]
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a similarity configuration is a JSON/YAML object")
    return data


# ----------------------------------------------------------------------------- vocabulary

# SimAKT's question rows are one data.Vocabulary whose ids are every (problem, skill) pair seen in training,
# "problem:skill", then every skill alone, "skill" (what an unseen problem of a known skill maps to; data without
# problem ids have the skills only): rows 0 padding, 1 unknown, then the pairs, then the skills. The skill and
# problem rows of each question row (`tables`) follow from those ids.

def build_vocab(ds: KTDataset, min_count: int = 1) -> Vocabulary:
    """min_count: a skill, or a (problem, skill) pair, seen fewer times than this gets no row of its own (a rare
    pair of a kept skill is answered by the skill's row, a rare skill by the unknown row)."""
    skills = Vocabulary.build(np.concatenate([s.questions for s in ds.sequences]), min_count=min_count)
    pairs = []
    if ds.sequences[0].problems is not None:
        counts = Counter((int(p), int(q)) for s in ds.sequences
                         for p, q in zip(s.problems, s.questions, strict=True))
        kept = set(skills.ids)
        pairs = sorted(pair for pair, n in counts.items() if n >= min_count and pair[1] in kept)
    return Vocabulary([f"{p}:{q}" for p, q in pairs] + [str(q) for q in skills.ids])


def vocab_parts(vocab: Vocabulary) -> tuple[list[tuple[int, int]], Vocabulary, Vocabulary]:
    """(the (problem, skill) pairs in row order, the skills' Vocabulary, the pairs' problems' Vocabulary)."""
    pairs = [tuple(int(x) for x in i.split(":")) for i in vocab.ids if ":" in i]
    skills = vocab.ids[len(pairs):]
    if all(_is_int_text(q) for q in skills):
        skills = [int(q) for q in skills]
    return pairs, Vocabulary(skills), Vocabulary.build(np.asarray([p for p, _ in pairs], dtype=np.int64))


def _is_int_text(text: str) -> bool:
    return text.lstrip("-").isdigit() and str(int(text)) == text


def vocab_tables(vocab: Vocabulary) -> tuple[torch.Tensor, torch.Tensor]:
    """(question row -> skill row, question row -> problem row)."""
    pairs, skills, problems = vocab_parts(vocab)
    n = len(vocab)
    skill, problem = np.ones(n, dtype=np.int64), np.ones(n, dtype=np.int64)
    skill[0] = problem[0] = 0
    if pairs:
        p, q = np.array(pairs).T
        skill[2:2 + len(p)], problem[2:2 + len(p)] = skills.encode(q), problems.encode(p)
    skill[2 + len(pairs):] = np.arange(2, len(skills))
    return torch.from_numpy(skill), torch.from_numpy(problem)


def encode_questions(vocab: Vocabulary, questions: np.ndarray, problems: np.ndarray | None) -> np.ndarray:
    """Rows: the (problem, skill) pair if seen in training, else the skill alone, else unknown (1)."""
    questions = np.asarray(questions)
    rows = vocab.encode(questions.astype(str))  # a bare skill's row (never a pair's: their ids hold a colon)
    if problems is not None and vocab.ids and ":" in vocab.ids[0]:
        keys = np.char.add(np.char.add(np.asarray(problems, dtype=np.int64).astype(str), ":"), questions.astype(str))
        pair_rows = vocab.encode(keys)
        rows = np.where(pair_rows != Vocabulary.UNKNOWN, pair_rows, rows)
    return rows.astype(np.int64)


def vocab_json(vocab: Vocabulary, problems: bool) -> dict:
    """The artifact's vocab_questions.json: its ids (what the service reads), with the skills, the problems (None
    for data without problem ids) and the pairs they are made of."""
    pairs, skills, problem_vocab = vocab_parts(vocab)
    return {"ids": list(vocab.ids), "skills": skills.ids, "problems": problem_vocab.ids if problems else None,
            "pairs": [list(p) for p in pairs]}


def sequences(ds: KTDataset, vocab: Vocabulary) -> list[Trajectory]:
    """Every sequence whole, as (question rows, responses)."""
    return [(encode_questions(vocab, s.questions, s.problems), s.responses) for s in ds.sequences]


def trajectories(ds: KTDataset, vocab: Vocabulary, window: int) -> tuple[list[Trajectory], list[str]]:
    """Every sequence cut into chunks of at most `window` (each starts afresh), with its student id: what
    training and the banks see."""
    out, ids = [], []
    for s, (rows, responses) in zip(ds.sequences, sequences(ds, vocab), strict=True):
        for i in range(0, len(rows), window):
            out.append((rows[i:i + window], responses[i:i + window]))
            ids.append(s.student_id)
    return out, ids


def bank_tensors(banks: list[Bank], device="cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [tuple(t.to(device) for t in b.tensors()) for b in banks]


def _device(model: SimAKT) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def predict(model: SimAKT, seqs: list[Trajectory], banks: list[Bank], batch_size: int = 64) -> tuple[np.ndarray,
                                                                                                      np.ndarray]:
    """P(right) and the response at every interaction of whole sequences, under the window rule the service
    answers by (`SimAKT.chunked`: chunks of the window, staggered by window / caches)."""
    model.eval()
    dev = _device(model)
    kv = model.bank_keys(bank_tensors(banks, dev))
    probs, targets = [], []
    for q, r, mask in batches(seqs, batch_size):
        probs.append(torch.sigmoid(model.chunked(q.to(dev), r.to(dev), kv))[mask.to(dev)].cpu().numpy())
        targets.append(r[mask].numpy())
    return np.concatenate(probs), np.concatenate(targets)


def binary_metrics(probs: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """auc, accuracy, nll and n of P(right) against 0/1 responses (metrics.ordinal_metrics with K = 2)."""
    m = ordinal_metrics(np.stack([1 - probs, probs], axis=1), targets)
    return {"auc": m["auc"], "accuracy": m["accuracy"], "nll": m["nll"], "n": int(m["n"])}


def split_folds(ids: list[str], rng: np.random.Generator, k: int = 2) -> list[list[int]]:
    """Positions of the trajectories in k folds by student: all of a student's chunks in one fold."""
    students = sorted(set(ids))
    fold_of = dict(zip(students, rng.permutation(len(students)) % k, strict=True))
    return [[i for i, s in enumerate(ids) if fold_of[s] == f] for f in range(k)]


def fit(model: SimAKT, fit_trajs: list[Trajectory], fit_ids: list[str], valid_seqs: list[Trajectory],
        cfg: SimAKTTrainConfig, log=print_line) -> list[dict]:
    """Adam with early stopping on validation AUC and a wall-clock budget; leaves the best weights loaded.

    The banks follow the weights: built before the first epoch, and after every epoch (from one encoding
    of the fit students) the next epoch's banks, one per fold, and the validation bank of all fit students."""
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    folds = split_folds(fit_ids, rng, cfg.bank_folds)
    others = [sorted(i for g, fold in enumerate(folds) if g != f for i in fold) for f in range(len(folds))]
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)  # the contrastive loss's augmentations
    banks = {"epoch": 0, "folds": [[] for _ in folds], "valid": []}

    def rebuild(epoch: int) -> None:
        """Banks of the current weights for `epoch`: one per fold (training: of the other folds' students) and one
        of all fit students (validation)."""
        banks["epoch"] = epoch
        folds_b, valid_b = [[] for _ in folds], []
        if model.sim.active:
            encoded = encode_trajectories(model, fit_trajs)
            folds_b = [select_banks(model, encoded, fit_ids, cfg.seed + epoch, rows) for rows in others]
            valid_b = select_banks(model, encoded, fit_ids, cfg.seed)
        if model.answerers:  # the peers' read-outs, with block 3 reading the bank of all fit students
            readouts = encode_readouts(model, fit_trajs, valid_b)
            folds_b = [b + select_answer_banks(model, readouts, fit_ids, cfg.seed + epoch, rows)
                       for b, rows in zip(folds_b, others, strict=True)]
            valid_b = valid_b + select_answer_banks(model, readouts, fit_ids, cfg.seed)
        banks["folds"], banks["valid"] = folds_b, valid_b

    def epoch_batches(epoch: int) -> list:
        if epoch == 1:
            rebuild(1)
        work = [(f, q, r, m) for f, fold in enumerate(folds)
                for q, r, m in batches([fit_trajs[i] for i in fold], cfg.batch_size, rng)]
        rng.shuffle(work)
        dev = _device(model)
        banks["raw"] = [bank_tensors(b, dev) for b in banks["folds"]]
        return work

    def step(batch):
        f, q, r, mask = batch
        dev = _device(model)
        q, r, mask = q.to(dev), r.to(dev), mask.to(dev)
        kv = model.bank_keys(banks["raw"][f])  # the other folds' students: never the student's own bank
        out = model(q, r, kv)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(out.logits[mask], r[mask].float())
        full = loss + cfg.problem_l2 * regularisation(model)
        if cfg.lambda_cl > 0:
            full = full + cfg.lambda_cl * contrastive_loss(model, q, r, mask, kv, out.knowledge, generator=gen)
        n = int(mask.sum())
        return full, n, {"loss": loss.item() * n}  # reported: the prediction loss alone

    def validate() -> dict:
        rebuild(banks["epoch"] + 1)  # the next epoch trains with the folds' banks
        return binary_metrics(*predict(model, valid_seqs, banks["valid"]))

    return train_epochs(model, cfg.epochs, epoch_batches, step, optimizer=opt, grad_clip=cfg.grad_clip,
                        validate=validate, monitor="valid_auc", lower_is_better=False, patience=cfg.patience,
                        max_seconds=cfg.max_minutes * 60, progress=False, report=lambda row: log(describe(row)),
                        say=log)


def refit_answer_heads(model: SimAKT, seqs: list[Trajectory], banks: list, iterations: int = 50) -> dict:
    """Fit the answer heads' output maps (`mix`, and the temperature where it is learned) on held-out students'
    sequences, everything else frozen, where a cross-fitted estimate on those students says it pays.

    Why: trained end to end, a head learns how much to trust its bank on the training students, where the rest
    of the model already fits the answers (and each question's difficulty) better than on students it has not
    seen, so it learns to ignore where the model misjudges a question for new students: the peers head's weight
    on what the model expected of the peers stays near 0. Fitted on students the encoder never trained on, it
    learns the weight a new student needs (what stacking does). The decision is the students' own: the output
    map is fitted on each half of them (by student) and scored on the other; only if the mean AUC of the two
    halves beats the end-to-end head's on the same halves is the map fitted on all of them and kept. `banks` must
    hold none of `seqs`' students (their own answers would be peers). Returns the estimate, the log loss and the
    output maps the heads end with."""
    model.eval()
    dev = _device(model)
    kv = model.bank_keys(bank_tensors(banks, dev))
    n = len(model.heads)
    h, questions, base, targets, owner = [], [], [], [], []
    with torch.no_grad():
        for i, (q, r) in enumerate(seqs):
            q, r = torch.as_tensor(q, device=dev)[None], torch.as_tensor(r, device=dev)[None]
            read = model.chunked_readouts(q, r, kv[:n])
            h.append(read[0]), questions.append(q[0]), targets.append(r[0].float())
            base.append(model.mlp(model.embed(q), read)[0]), owner.append(torch.full_like(q[0], i % 2))
    h, questions, base, targets, owner = (torch.cat(x)[None] for x in (h, questions, base, targets, owner))
    params = [p for head in model.answerers for p in (*head.mix.parameters(), head.log_temperature)
              if p is not None]
    start = [p.detach().clone() for p in params]

    def logits(rows=slice(None)) -> torch.Tensor:
        return base[:, rows] + sum(head(h[:, rows], questions[:, rows], *bank)
                                   for head, bank in zip(model.answerers, kv[n:], strict=True))

    def refit(rows) -> None:
        with torch.no_grad():
            for p, value in zip(params, start, strict=True):
                p.copy_(value)
        opt = torch.optim.LBFGS(params, max_iter=iterations, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            value = torch.nn.functional.binary_cross_entropy_with_logits(logits(rows), targets[:, rows])
            value.backward()
            return value

        opt.step(closure)

    def halves_auc(scores: dict[int, torch.Tensor]) -> float:
        return float(np.mean([binary_metrics(torch.sigmoid(scores[k]).numpy(),
                                             targets[owner == k].long().numpy())["auc"] for k in (0, 1)]))

    with torch.no_grad():
        end_to_end = logits()
        before = torch.nn.functional.binary_cross_entropy_with_logits(end_to_end, targets).item()
    held = {}
    for k in (0, 1):
        refit((owner != k)[0])
        with torch.no_grad():
            held[k] = logits((owner == k)[0])[0]
    estimate = {"auc_end_to_end": halves_auc({k: end_to_end[owner == k] for k in (0, 1)}),
                "auc_refit": halves_auc(held)}
    keep = estimate["auc_refit"] > estimate["auc_end_to_end"]
    if keep:
        refit(slice(None))
    else:
        with torch.no_grad():
            for p, value in zip(params, start, strict=True):
                p.copy_(value)
    with torch.no_grad():
        after = torch.nn.functional.binary_cross_entropy_with_logits(logits(), targets).item()
    maps = {head.spec.name: {"mix": [round(w, 6) for w in head.mix.weight.detach().flatten().tolist()],
                             "bias": round(head.mix.bias.item(), 6),
                             "temperature": round(head.temperature().item(), 6)} for head in model.answerers}
    return {"applied": keep, "crossfit": estimate, "nll_before": before, "nll_after": after,
            "interactions": int(targets.numel()), "maps": maps}


def train_entry(entry, data_dir: str | Path, out_dir: str | Path, *, cfg: SimAKTTrainConfig, **options) -> dict:
    """The registry's run (families.py: `(entry, data, out, *, cfg, **options)`): SimAKT is its family's only one."""
    return train_simakt(data_dir, out_dir, cfg=cfg, name=entry.name, **options)


def train_simakt(data_dir: str | Path, out_dir: str | Path | None, *, cfg: SimAKTTrainConfig,
                 similarity: dict | None = None, name: str = "simakt", export: bool = True, log=print_line,
                 datasets: tuple[KTDataset, KTDataset] | None = None) -> dict:
    """Train, evaluate on the test file, and (export=True) export to out_dir; returns the manifest (without
    export: the manifest's metrics and training sections, for sweeps on machines without ONNX). `datasets`: the
    (train, test) data sets already read, in place of data_dir's files (`nextstep tune`: training learners held
    out as the test)."""
    data_dir = Path(data_dir)
    parse_similarity(similarity or {}, cfg.model.get("n_heads", 8))  # fail before reading data on a bad file
    if isinstance(cfg.bank_folds, bool) or not isinstance(cfg.bank_folds, int) or cfg.bank_folds < 2:
        raise ConfigError("bank_folds", f"must be an integer >= 2 (the folds banks are cross-fitted over), got "
                                        f"{cfg.bank_folds!r}")
    started = time.perf_counter()
    train_ds, test_ds = datasets or load_dataset(data_dir)
    if train_ds.n_cats != 2:
        raise ValueError(f"{train_ds.path}: SimAKT predicts right/wrong responses; this data has K = {train_ds.n_cats}")
    fit_ds, valid_ds = split_students(train_ds, cfg.valid_fraction, cfg.seed)
    # ids seen only by validation or test students are unknown, as in serving; so are rare ones, and a share of the
    # fitting interactions is given as unknown: the unknown row learns an average question (run.py)
    vocab = build_vocab(fit_ds, min_count=cfg.min_question_count)
    has_problems = fit_ds.sequences[0].problems is not None
    _, skill_vocab, problem_vocab = vocab_parts(vocab)
    model_cfg = SimAKTConfig(n_questions=len(vocab), n_skills=len(skill_vocab),
                             n_problems=len(problem_vocab) if has_problems else 0,
                             similarity=similarity or {}, **cfg.model)
    torch.manual_seed(cfg.seed)
    model = SimAKT(model_cfg)
    skill, problem = vocab_tables(vocab)
    model.question_skill.copy_(skill)
    model.question_problem.copy_(problem)
    fit_trajs, fit_ids = trajectories(fit_ds, vocab, model_cfg.window)
    fit_trajs = list(zip(hide_ids([q for q, _ in fit_trajs], cfg.unknown_share, cfg.seed), [r for _, r in fit_trajs],
                         strict=True))
    unknown = unknown_record(len(skill_vocab.ids), len(np.unique(np.concatenate([s.questions for s in
                                                                                 fit_ds.sequences]))),
                             cfg.min_question_count, cfg.unknown_share, [q for q, _ in fit_trajs])
    valid_trajs, valid_ids = trajectories(valid_ds, vocab, model_cfg.window)
    test_seqs = sequences(test_ds, vocab)
    valid_seqs = sequences(valid_ds, vocab)
    history = fit(model.to(cfg.device), fit_trajs, fit_ids, valid_seqs, cfg, log)

    banks = build_banks(model, fit_trajs + valid_trajs, fit_ids + valid_ids, cfg.seed)
    refit = {}
    if model.answerers and cfg.refit_answer_heads:  # on the validation students, with a bank of fit students only
        end_to_end = binary_metrics(*predict(model, test_seqs, banks))
        refit = refit_answer_heads(model, valid_seqs, build_banks(model, fit_trajs, fit_ids, cfg.seed))
        refit["test_end_to_end"] = end_to_end
        log(f"answer heads' refit on the validation students: cross-fitted auc {refit['crossfit']['auc_refit']:.4f} "
            f"against {refit['crossfit']['auc_end_to_end']:.4f} end to end, "
            f"{'applied' if refit['applied'] else 'not applied'}; test auc end to end {end_to_end['auc']:.4f}")
    train_seconds = time.perf_counter() - started
    probs, targets = predict(model, test_seqs, banks)
    model = model.cpu()
    best = [h for h in history if h["best"]][-1]
    metrics = {"test": {**binary_metrics(probs, targets),
                        "unknown_questions": int(sum((q == 1).sum() for q, _ in test_seqs))},
               "valid": {k.removeprefix("valid_"): v for k, v in best.items() if k.startswith("valid_")},
               # one P(right) for every answer, the fitting learners' share of right answers: the figure to beat
               "baseline": {"name": "base rate", **binary_metrics(np.full(len(targets), np.mean(
                   np.concatenate([s.responses for s in fit_ds.sequences]))), targets)},
               **({"answer_refit": refit} if refit else {})}
    log(f"test auc {metrics['test']['auc']:.4f}  acc {metrics['test']['accuracy']:.4f}  "
        f"nll {metrics['test']['nll']:.4f}  ({train_seconds:.0f}s)")
    version = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    manifest = {
        "name": name, "version": version, "task": "knowledge_tracing",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "data": {"dir": str(data_dir), "format": train_ds.fmt, "train_file": train_ds.path, "test_file": test_ds.path,
                 "fingerprint": fingerprint(train_ds.path, test_ds.path), "n_fit_students": len(fit_ds),
                 "n_valid_students": len(valid_ds), "n_test_students": len(test_ds)},
        "responses": {"n_cats": 2},
        "unknown": unknown,
        "metrics": metrics,
        "train_config": asdict(cfg),
        "training": {"epochs_run": len(history), "best_epoch": best["epoch"], "seconds": round(train_seconds, 1),
                     "history": history, "torch": torch.__version__},
    }
    if not export:
        return manifest
    bank_prov = provenance(model, train_ds.path, fit_ids + valid_ids, cfg.seed) if banks else None
    return export_simakt(model, Path(out_dir), manifest=manifest, vocab_json=vocab_json(vocab, has_problems),
                         banks=banks, bank_provenance=bank_prov, parity=test_seqs)


def evaluate_simakt(artifact_dir: str | Path, data_dir: str | Path, bank_version: str | None = None) -> dict:
    """`nextstep evaluate` for SimAKT: the artifact's model with one of its bank versions (default: the one
    exported with it) on the data set's test file."""
    artifact_dir = Path(artifact_dir)
    model, manifest = load_simakt(artifact_dir)
    version = bank_version or manifest["banks"]["default"]
    banks = load_banks(artifact_dir / manifest["banks"]["dir"] / version, model) if model.sim.active else []
    vocab = Vocabulary.from_json(json.loads((artifact_dir / manifest["vocabularies"]["questions"]).read_text()))
    _, test_ds = load_dataset(data_dir)
    seqs = sequences(test_ds, vocab)
    return {**binary_metrics(*predict(model, seqs, banks)), "bank_version": version if banks else None,
            "unknown_questions": int(sum((q == 1).sum() for q, _ in seqs))}


def build_artifact_banks(artifact_dir: str | Path, data_dir: str | Path, *, version: str | None = None,
                         seed: int = 0) -> dict:
    """`nextstep banks build`: encode the data set's training students with the artifact's weights and
    write new banks to ARTIFACT/banks/<version>. The test file is not opened."""
    artifact_dir = Path(artifact_dir)
    model, manifest = load_simakt(artifact_dir)
    if not (model.sim.active or model.answerers):
        raise ValueError(f"{artifact_dir}: the model has no active inter-student or answer head, so it uses no bank")
    train_path, _, fmt, kwargs = find_split_files(data_dir)
    reader = READERS[fmt]  # every knowledge-tracing format, the long CSV included
    train = reader(train_path, **kwargs)
    vocab = Vocabulary.from_json(json.loads((artifact_dir / manifest["vocabularies"]["questions"]).read_text()))
    trajs, ids = trajectories(train, vocab, model.cfg.window)
    banks = build_banks(model, trajs, ids, seed)
    version = version or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = artifact_dir / manifest["banks"]["dir"] / version
    if out.exists():
        raise FileExistsError(f"{out} exists: bank versions are immutable, choose another --version")
    save_banks(banks, out, provenance(model, str(train_path), ids, seed))
    return {"artifact": str(artifact_dir), "version": version, "dir": str(out),
            "banks": {b.head: {"type": b.type, "entries": b.entries} for b in banks},
            "trajectories": len(trajs), "students": len(set(ids))}
