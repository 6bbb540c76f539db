"""The shared training loop (loop.train_epochs) and the knowledge-tracing path for models without IRT outputs."""

import io
import re
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nextstep.training.families import family
from nextstep.training.kt.loop import TrainConfig, fit, predict_sequences
from nextstep.training.loop import duration, print_row, train_epochs


def regression(seed: int = 0):
    """A linear model, 4 batches of a noisy linear problem, and a mean-squared-error step."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 3, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.1 * torch.randn(64, generator=g)
    model = torch.nn.Linear(3, 1)

    def step(batch):
        xb, yb = batch
        return ((model(xb).squeeze(1) - yb) ** 2).mean(), len(yb)

    return model, (lambda epoch: [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]), step


def scripted(values, model, snapshots):
    """A validation that reports the next scripted value and remembers the weights it saw."""
    it = iter(values)

    def validate():
        snapshots.append({k: v.clone() for k, v in model.state_dict().items()})
        return {"score": next(it)}

    return validate


@pytest.mark.parametrize("lower_is_better, values, best_epoch, epochs_run", [
    (True, [3.0, 2.0, 2.5, 2.1, 2.2, 1.0], 2, 5),  # stops after 3 epochs without improvement
    (False, [0.1, 0.3, 0.2, 0.5, 0.4, 0.4], 4, 6),
])
def test_early_stopping_keeps_and_saves_the_best_epochs_weights(tmp_path, lower_is_better, values, best_epoch,
                                                                 epochs_run):
    model, batches, step = regression()
    seen = []
    history = train_epochs(model, 6, batches, step, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                           validate=scripted(values, model, seen), monitor="valid_score",
                           lower_is_better=lower_is_better, patience=3, checkpoint=tmp_path / "best.pt")
    assert len(history) == epochs_run
    assert [row["epoch"] for row in history if row["best"]][-1] == best_epoch
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, seen[best_epoch - 1][name], rtol=0, atol=0)
    saved = torch.load(tmp_path / "best.pt", weights_only=True)
    assert saved["epoch"] == best_epoch and saved["valid"] == {"score": values[best_epoch - 1]}
    assert not model.training


def test_without_a_monitor_every_epoch_runs_and_the_last_weights_stay():
    model, batches, step = regression()
    history = train_epochs(model, 4, batches, step, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    assert [row["epoch"] for row in history] == [1, 2, 3, 4] and "best" not in history[0]
    assert history[-1]["train_loss"] < history[0]["train_loss"] and history[0]["targets"] == 64
    final = ((model(batches(0)[0][0]).squeeze(1) - batches(0)[0][1]) ** 2).mean()
    assert final.item() < history[0]["train_loss"]  # the last weights, not the first


def test_the_train_loss_is_per_target_and_matches_a_hand_written_sgd_loop():
    model, batches, step = regression()
    reference = torch.nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())
    history = train_epochs(model, 2, batches, step, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                           grad_clip=0.5)
    opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    for _ in range(2):
        total = 0.0
        for xb, yb in batches(0):
            loss = ((reference(xb).squeeze(1) - yb) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
            opt.step()
            total += loss.item() * len(yb)
    assert history[-1]["train_loss"] == total / 64
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _sgd_with_average(model, batches, epochs: int, decay: float):
    """A hand-written SGD loop and the moving average of its parameters after every step, at each epoch's end."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    average, averaged = None, []
    for _ in range(epochs):
        for xb, yb in batches(0):
            loss = ((model(xb).squeeze(1) - yb) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            now = [p.detach().clone() for p in model.parameters()]
            if average is not None:
                now = [decay * a + (1 - decay) * p for a, p in zip(average, now, strict=True)]
            average = now
        averaged.append([a.clone() for a in average])
    return averaged


@pytest.mark.parametrize("monitored", [False, True])
def test_the_average_is_validated_and_kept_while_training_goes_on_from_the_trained_weights(monitored):
    model, batches, step = regression()
    reference = torch.nn.Linear(3, 1)
    reference.load_state_dict(model.state_dict())
    averaged = _sgd_with_average(reference, batches, 3, decay=0.6)
    seen = []
    train_epochs(model, 3, batches, step, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), average=0.6,
                 validate=scripted([2.0, 1.0, 3.0], model, seen), monitor="valid_score" if monitored else None)
    # every epoch validated the average of the one trajectory the hand-written loop took (so training went on
    # from the trained weights, not from the average); the best epoch's (2) or, unmonitored, the last one stays
    for epoch, snapshot in enumerate(seen):
        for a, b in zip(snapshot.values(), averaged[epoch], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    kept = averaged[1] if monitored else averaged[2]
    for a, b in zip(model.parameters(), kept, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_an_average_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match="average"):
        TrainConfig(average=1.0)


def test_a_step_that_updates_itself_reports_sums_and_parts():
    model = torch.nn.Linear(1, 1)
    batches = lambda epoch: [3, 5]  # noqa: E731

    def step(n):
        with torch.no_grad():
            model.bias.add_(1.0)  # the step's own update
        return None, n, {"loss": 2.0 * n, "part": 1.0 * n}

    before = model.bias.item()
    history = train_epochs(model, 2, batches, step, before_epoch=lambda epoch: {"stage": epoch * 10})
    assert history[0]["stage"] == 10 and history[1]["stage"] == 20
    assert history[0]["train_loss"] == 2.0 and history[0]["train_part"] == 1.0 and history[0]["targets"] == 8
    assert model.bias.item() == pytest.approx(before + 4) and "lr" not in history[0]  # 4 steps, weights kept


def test_a_diverged_epoch_raises():
    model = torch.nn.Linear(1, 1)
    with pytest.raises(FloatingPointError, match="epoch 1"):
        train_epochs(model, 3, lambda epoch: [1], lambda b: (None, 1, {"loss": float("nan")}))


def test_the_time_budget_starts_no_epoch_that_would_overrun_it():
    import time

    model = torch.nn.Linear(1, 1)

    def slow(batch):
        time.sleep(0.05)
        return None, 1, {"loss": 1.0}

    history = train_epochs(model, 50, lambda epoch: [0], slow, max_seconds=0.18)
    assert 2 <= len(history) <= 3


def test_the_lr_schedule_sees_every_epochs_score():
    model, batches, step = regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    history = train_epochs(model, 4, batches, step, optimizer=opt, validate=scripted([1.0, 2.0, 3.0, 0.5], model, []),
                           monitor="valid_score", lr_schedule=schedule)
    assert [row["lr"] for row in history] == [0.1, 0.1, 0.05, 0.025]  # the lr each epoch trained with


def test_progress_in_a_log_file_is_one_line_per_epoch(capsys):
    model, batches, step = regression()
    train_epochs(model, 3, batches, step, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                 progress=True, report=print_row)  # pytest's stderr is not a terminal: no bar
    out, err = capsys.readouterr()
    assert err == "" and "\r" not in out
    lines = out.splitlines()
    assert len(lines) == 3 and lines[0].startswith("epoch   1  train_loss ") and "targets/s" in lines[0]


class Terminal(io.StringIO):
    """A stderr that says it is a terminal: the loop draws its progress bar into it."""

    def isatty(self) -> bool:
        return True


def _written_seqs(n: int = 40, seed: int = 0):
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(n):  # responses follow the question: learnable from the question alone
        q = rng.integers(2, 8, size=rng.integers(5, 20))
        seqs.append((q, (q % 2).astype(np.int64)))
    return seqs


def test_the_progress_bar_counts_the_epochs_batches(monkeypatch):
    """The bar said `epoch 1/5: 9it [00:13, 1.74s/it]`: no total, so no share done and no time left."""
    seqs = _written_seqs()
    _, batcher, loss, metrics = family("dkt").parts()
    monkeypatch.setattr(sys, "stderr", Terminal())
    fit(LogProbsOnly(8), seqs[:30], seqs[30:], TrainConfig(epochs=1, batch_size=8), batcher=batcher, loss=loss,
        metrics=metrics, progress=True, log=False)
    shown = sys.stderr.getvalue()
    assert re.search(r"epoch 1/1: +0%\|.*\| 0/4 \[00:00<\?", shown), shown  # 30 sequences, 8 a batch: 4 batches


class LogProbsOnly(torch.nn.Module):
    """A knowledge-tracing model shaped like DKT: an LSTM over (question, response), log_probs only."""

    def __init__(self, n_questions: int, n_cats: int = 2):
        super().__init__()
        self.cfg = SimpleNamespace(n_cats=n_cats)
        self.embed = torch.nn.Embedding(n_questions * n_cats, 8)
        self.query = torch.nn.Embedding(n_questions, 8)
        self.lstm = torch.nn.LSTM(8, 8, batch_first=True)
        self.out = torch.nn.Linear(16, n_cats)
        self.n_cats = n_cats

    def forward(self, q, r):
        past = torch.nn.functional.pad(self.embed(q * self.n_cats + r)[:, :-1], (0, 0, 1, 0))
        h, _ = self.lstm(past)
        return SimpleNamespace(log_probs=torch.log_softmax(self.out(torch.cat([h, self.query(q)], -1)), -1))


def test_models_without_irt_outputs_train_and_evaluate():
    seqs = _written_seqs()
    torch.manual_seed(0)
    model = LogProbsOnly(8)
    _, batcher, loss, metrics = family("dkt").parts()
    history = fit(model, seqs[:30], seqs[30:], TrainConfig(epochs=15, lr=0.03, batch_size=8, monitor="auc"),
                  batcher=batcher, loss=loss, metrics=metrics, progress=False, log=False)
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert max(row["valid_auc"] for row in history) > 0.9
    pred = predict_sequences(model, seqs[30:])
    assert set(pred) == {"probs", "targets", "questions"}
    assert len(pred["probs"]) == sum(len(q) for q, _ in seqs[30:])


@pytest.mark.parametrize("values, best_epoch, rows", [
    ([1.0, 2.0, 1.5, 3.0, 0.5], 0, 4),  # the start is never beaten: its weights come back, 3 stale epochs end it
    ([3.0, 2.0, 2.5, 2.1, 2.2, 2.3], 1, 5),  # an epoch beats the start
])
def test_validate_start_lets_the_starting_weights_compete(values, best_epoch, rows):
    model, batches, step = regression()
    seen = []
    history = train_epochs(model, 5, batches, step, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                           validate=scripted(values, model, seen), monitor="valid_score", patience=3,
                           validate_start=True)
    assert [row["epoch"] for row in history] == list(range(rows))
    assert history[0]["valid_score"] == values[0] and history[0]["best"] and "train_loss" not in history[0]
    assert [row["epoch"] for row in history if row["best"]][-1] == best_epoch
    for name, value in model.state_dict().items():  # seen[0]: the weights before any step
        torch.testing.assert_close(value, seen[best_epoch][name], rtol=0, atol=0)
    assert not torch.equal(seen[0]["weight"], seen[1]["weight"])  # training did move them


# -- what the training says of its length -------------------------------------------------------------------------

def test_the_training_says_what_it_will_run_and_after_its_first_epoch_how_long_the_rest_takes():
    """deep_gpcm's cap of 60 epochs with a patience of 8 was said nowhere, nor how long the run would take."""
    model, batches, step = regression()
    said = []
    train_epochs(model, 6, batches, step, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                 validate=scripted([3.0, 2.0, 2.5, 2.1, 2.2, 1.0], model, []), monitor="valid_score", patience=3,
                 say=said.append)
    assert said[0] == ("training: up to 6 epochs, stopping once 3 in a row bring no better valid_score (the best "
                       "epoch's weights are kept)")
    assert re.fullmatch(r"training: epoch 1 took \d+ s; the 5 other epochs take at most \d+ s more at this pace "
                        r"\(early stopping usually ends them sooner\)", said[1]), said
    assert len(said) == 2  # (no epoch is long enough for a line within it)
    said.clear()
    train_epochs(model, 3, batches, step, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), say=said.append)
    assert said[0] == "training: 3 epochs" and said[1].endswith("; the other 2 take about 0 s more at this pace")


def test_without_a_progress_bar_a_long_epoch_says_where_it_is(monkeypatch):
    """In a log file nothing was printed between epoch lines, which a busy machine puts minutes apart."""
    import nextstep.training.loop as loop

    monkeypatch.setattr(loop, "HEARTBEAT_SECONDS", 0.0)  # a line at every batch but the first
    model, batches, step = regression()
    said = []
    train_epochs(model, 1, lambda epoch: loop.Counted(batches(epoch), 4), step,
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.05), say=said.append)
    assert said[1:] == [f"training: epoch 1/1 at batch {i} of 4 after 0 s, about 0 s left in it" for i in (1, 2, 3)]
    said.clear()
    train_epochs(model, 1, lambda epoch: iter(batches(epoch)), step, say=said.append)  # batches not counted
    assert said[1:] == [f"training: epoch 1/1 at batch {i} after 0 s" for i in (1, 2, 3)]
    said.clear()
    monkeypatch.setattr(sys, "stderr", Terminal())  # a bar says it there
    train_epochs(model, 1, batches, step, progress=True, say=said.append)
    assert said == ["training: 1 epoch"]


@pytest.mark.parametrize("seconds, text", [(0.4, "0 s"), (45, "45 s"), (190, "3 min 10 s"), (1500, "25 min"),
                                           (7500, "2 h 5 min")])
def test_durations_read_as_a_person_reads_them(seconds, text):
    assert duration(seconds) == text
