"""SimAKT memory banks: built offline from training students' complete trajectories, saved as .npy.

    trajectories (question rows, responses), training students only
      -> encoded by the trained model: block 2's states hs (N, L, d), padded to the model's window
      -> summary per trajectory: the mean of its valid states (N, d)
      -> per active inter-student head: the head class's `select` groups trajectories into entries
         (k-means clusters; farthest-first samples), an entry's states are its members' per-position mean
      -> banks/<version>/<head>_states.npy (M, L, d) float32, <head>_lengths.npy (M,) int64,
         <head>_summaries.npy (M, d), <head>_sizes.npy (M,) members per entry, and provenance.json:
         which data file, which students (ids and a hash), which weights, when, with what settings.

No pickle anywhere: a bank is arrays and JSON. Test students never reach this module: `build_banks` takes
trajectories and their student ids, and the callers pass training students only (tests prove it).
"""

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...models.simakt import SimAKT

BANK_FILES = ("states", "lengths", "summaries", "sizes")


@dataclass
class Bank:
    head: str  # the inter-student head (and bank) name
    type: str
    states: np.ndarray  # (M, L, d) float32
    lengths: np.ndarray  # (M,) int64
    summaries: np.ndarray  # (M, d) float32
    sizes: np.ndarray  # (M,) int64: trajectories averaged into each entry
    sources: list[list[str]]  # student ids behind each entry (knn: one; cluster: its members)
    # a bank read back from disk (load_banks): its provenance's {"students", "students_sha256"}, which save_banks
    # writes again where the ids themselves were not saved (cluster members, answer banks)
    recorded: dict | None = None

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(self.states), torch.from_numpy(self.lengths)

    @property
    def entries(self) -> int:
        return len(self.lengths)


@torch.no_grad()
def encode_trajectories(model: SimAKT, trajectories: list[tuple[np.ndarray, np.ndarray]],
                        batch_size: int = 64) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(states (N, W, d) float32 zero-padded, lengths (N,), summaries (N, d)) of trajectories <= window long."""
    was_training = model.training
    model.eval()
    W, d = model.cfg.window, model.cfg.d_model
    states = np.zeros((len(trajectories), W, d), dtype=np.float32)
    lengths = np.array([len(q) for q, _ in trajectories], dtype=np.int64)
    if (lengths > W).any() or (lengths < 1).any():
        raise ValueError(f"trajectories must be 1..{W} interactions long (cut them to the model's window)")
    order = np.argsort(lengths, kind="stable")
    dev = model.skill_embed.weight.device
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        T = int(lengths[idx].max())
        q = np.zeros((len(idx), T), dtype=np.int64)
        r = np.zeros((len(idx), T), dtype=np.int64)
        for row, i in enumerate(idx):
            q[row, :lengths[i]], r[row, :lengths[i]] = trajectories[i]
        hs = model.trajectory_states(torch.from_numpy(q).to(dev), torch.from_numpy(r).to(dev))
        states[idx, :T] = hs.cpu().numpy()
    valid = np.arange(W)[None, :] < lengths[:, None]
    states *= valid[..., None]  # padding rows are zero, not block 2's output for the padding id
    summaries = (states.sum(1) / lengths[:, None]).astype(np.float32)
    model.train(was_training)
    return states, lengths, summaries


def build_banks(model: SimAKT, trajectories: list[tuple[np.ndarray, np.ndarray]], student_ids: list[str],
                seed: int = 0) -> list["Bank | AnswerBank"]:
    """One bank per active head of `model` (block 3's inter-student heads, then the answer heads), from these
    (training) trajectories."""
    if len(trajectories) != len(student_ids):
        raise ValueError("one student id per trajectory")
    banks = select_banks(model, encode_trajectories(model, trajectories), student_ids, seed) if model.sim.active \
        else []
    if model.answerers:
        banks += select_answer_banks(model, encode_readouts(model, trajectories, banks), student_ids, seed)
    return banks


def select_banks(model: SimAKT, encoded: tuple[np.ndarray, np.ndarray, np.ndarray], student_ids: list[str],
                 seed: int = 0, rows: list[int] | None = None) -> list[Bank]:
    """Banks from already encoded trajectories (encode_trajectories), optionally only `rows` of them."""
    states, lengths, summaries = encoded
    if rows is not None:
        states, lengths, summaries = states[rows], lengths[rows], summaries[rows]
        student_ids = [student_ids[i] for i in rows]
    banks = []
    for _, spec in model.sim.active:
        groups = type(model.block3.inter[spec.name]).select(summaries, spec, seed)
        if spec.type == "knn" and len(groups) < spec.k_neighbors:
            raise ValueError(f"head {spec.name!r}: {len(groups)} bank entries from {len(lengths)} "
                             f"trajectories, fewer than its k_neighbors={spec.k_neighbors}")
        M, W = len(groups), states.shape[1]
        b_states = np.zeros((M, W, states.shape[2]), dtype=np.float32)
        b_lengths = np.zeros(M, dtype=np.int64)
        for m, members in enumerate(groups):
            count = (np.arange(W)[None, :] < lengths[members][:, None]).sum(0)  # members alive at each position
            b_states[m] = states[members].sum(0) / np.maximum(count, 1)[:, None]
            b_lengths[m] = lengths[members].max()
        banks.append(Bank(spec.name, spec.type, b_states, b_lengths,
                          np.stack([summaries[g].mean(0) for g in groups]).astype(np.float32),
                          np.array([len(g) for g in groups], dtype=np.int64),
                          [[student_ids[i] for i in g] for g in groups]))
    return banks


@dataclass
class AnswerBank:
    """The bank of a head at the answer (layers/similarity.py's AnswerHead): tensors in the order of its `parts`."""

    head: str
    type: str
    parts: dict[str, np.ndarray]
    students: list[str]  # the training students whose interactions it holds
    recorded: dict | None = None  # as Bank's: the provenance's student count and hash of a bank read back

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(torch.from_numpy(v) for v in self.parts.values())

    @property
    def entries(self) -> int:
        return len(next(iter(self.parts.values())))  # the first part has a row per entry


@torch.no_grad()
def encode_readouts(model: SimAKT, trajectories: list[tuple[np.ndarray, np.ndarray]], block3: list[Bank] = (),
                    batch_size: int = 64) -> dict[str, torch.Tensor]:
    """Every interaction of trajectories <= window long: its read-out h before the answer (N, d), question row,
    response, the answer MLP's P(right) ("expected", without answer heads) and trajectory index ("owner"), with
    block 3 reading `block3` (banks of the model's inter-student heads)."""
    was_training = model.training
    model.eval()
    dev = model.skill_embed.weight.device
    kv = [head.project(*(t.to(dev) for t in b.tensors())) for head, b in zip(model.heads, block3, strict=True)]
    out = {"h": [], "rows": [], "responses": [], "expected": [], "owner": []}
    order = np.argsort([len(q) for q, _ in trajectories], kind="stable")  # batches of like lengths: little padding
    for start in range(0, len(order), batch_size):
        chosen = order[start:start + batch_size]
        part = [trajectories[i] for i in chosen]
        T = max(len(q) for q, _ in part)
        q, r = np.zeros((len(part), T), np.int64), np.zeros((len(part), T), np.int64)
        mask = np.zeros((len(part), T), bool)
        for i, (qi, ri) in enumerate(part):
            q[i, :len(qi)], r[i, :len(qi)], mask[i, :len(qi)] = qi, ri, True
        questions = torch.from_numpy(q).to(dev)
        h = model.readouts(questions, torch.from_numpy(r).to(dev), kv)
        expected = torch.sigmoid(model.mlp(model.embed(questions), h)).cpu()
        m = torch.from_numpy(mask)
        out["h"].append(h.cpu()[m]), out["rows"].append(torch.from_numpy(q[mask])), out["responses"].append(
            torch.from_numpy(r[mask]))
        out["expected"].append(expected[m])
        out["owner"].append(torch.from_numpy(np.repeat(chosen, mask.sum(1))))
    model.train(was_training)
    return {k: torch.cat(v) for k, v in out.items()}


def select_answer_banks(model: SimAKT, readouts: dict[str, torch.Tensor], student_ids: list[str], seed: int = 0,
                        rows: list[int] | None = None) -> list[AnswerBank]:
    """A bank per active answer head from encoded read-outs (encode_readouts), optionally of the trajectories
    `rows` only."""
    keep = torch.ones(len(readouts["owner"]), dtype=torch.bool)
    if rows is not None:
        chosen = torch.zeros(len(student_ids), dtype=torch.bool)
        chosen[torch.as_tensor(rows, dtype=torch.long)] = True
        keep = chosen[readouts["owner"]]
    owners = readouts["owner"][keep].unique().tolist()
    students = sorted({student_ids[i] for i in owners})
    banks = []
    for head in model.answerers:
        generator = torch.Generator().manual_seed(seed)
        tensors = head.build({k: v[keep] for k, v in readouts.items() if k != "owner"}, model.cfg.n_questions,
                             generator)
        banks.append(AnswerBank(head.spec.name, head.spec.type,
                                dict(zip(head.parts, (t.cpu().numpy() for t in tensors), strict=True)), students))
    return banks


def weights_hash(model: SimAKT) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def _students(students: list[str], recorded: dict | None) -> dict:
    """A bank's provenance fields for its students: their number and a hash of their sorted ids, or what was
    recorded for a bank read back without its ids."""
    if not students and recorded:
        return dict(recorded)
    return {"students": len(students), "students_sha256": hashlib.sha256("\n".join(students).encode()).hexdigest()[:16]}


def save_banks(banks: list[Bank], out_dir: Path, provenance: dict) -> Path:
    """Write the banks and provenance.json into out_dir (created); returns out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    for b in banks:
        if isinstance(b, AnswerBank):
            for part, array in b.parts.items():
                np.save(out_dir / f"{b.head}_{part}.npy", array, allow_pickle=False)
            entries.append({"head": b.head, "type": b.type, "stage": "answer",
                            "entries": b.entries, **_students(b.students, b.recorded),
                            "files": {p: f"{b.head}_{p}.npy" for p in b.parts}})
            continue
        for part in BANK_FILES:
            np.save(out_dir / f"{b.head}_{part}.npy", getattr(b, part), allow_pickle=False)
        students = sorted({s for src in b.sources for s in src})
        entries.append({"head": b.head, "type": b.type, "entries": len(b.lengths), "window": b.states.shape[1],
                        "d_model": b.states.shape[2], **_students(students, b.recorded),
                        "sources": b.sources if b.type != "cluster" else None,
                        "files": {p: f"{b.head}_{p}.npy" for p in BANK_FILES}})
    (out_dir / "provenance.json").write_text(json.dumps({**provenance, "banks": entries}, indent=2))
    return out_dir


def load_banks(bank_dir: Path, model: SimAKT) -> list[Bank]:
    """The banks in bank_dir for `model`'s active heads, checked against its window and width."""
    bank_dir = Path(bank_dir)
    prov = json.loads((bank_dir / "provenance.json").read_text())
    by_head = {e["head"]: e for e in prov["banks"]}
    missing = [h.spec.name for h in model.heads + model.answerers if h.spec.name not in by_head]
    if missing:
        raise ValueError(f"{bank_dir}: no bank for head {missing[0]!r} (has {sorted(by_head)})")
    banks = []
    for _, spec in model.sim.active:
        e = by_head[spec.name]
        arrays = {p: np.load(bank_dir / e["files"][p], allow_pickle=False) for p in BANK_FILES}
        M = len(arrays["lengths"])
        if arrays["states"].shape != (M, model.cfg.window, model.cfg.d_model) or arrays["states"].dtype != np.float32:
            raise ValueError(f"{bank_dir}: bank {spec.name!r} states are {arrays['states'].dtype}"
                             f"{arrays['states'].shape}, the model needs float32 ({M}, {model.cfg.window}, "
                             f"{model.cfg.d_model})")
        banks.append(Bank(spec.name, e["type"], arrays["states"], arrays["lengths"].astype(np.int64),
                          arrays["summaries"], arrays["sizes"], e.get("sources") or [[] for _ in range(M)],
                          _recorded(e)))
    for head in model.answerers:
        e = by_head[head.spec.name]
        parts = {p: np.load(bank_dir / e["files"][p], allow_pickle=False) for p in head.parts}
        banks.append(AnswerBank(head.spec.name, e["type"], parts, [], _recorded(e)))
    return banks


def _recorded(entry: dict) -> dict | None:
    """A provenance entry's student count and hash, where it has them."""
    if "students" in entry and "students_sha256" in entry:
        return {"students": entry["students"], "students_sha256": entry["students_sha256"]}
    return None


def provenance(model: SimAKT, data_file: str, students: list[str], seed: int) -> dict:
    return {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "data_file": str(data_file),
            "n_trajectories": len(students), "n_students": len(set(students)), "seed": seed,
            "model_weights_sha256": weights_hash(model), "similarity": model.sim.to_dict()}
