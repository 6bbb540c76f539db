"""SimAKT memory banks in the service: versions kept in the store, one active version, projected once per process.

A bank version is the files of `<artifact>/banks/<version>/` (per inter-student head: states, lengths,
summaries and sizes as .npy; per answer head, its parts, e.g. the peers' keys, responses, first and count; and
provenance.json). In Redis, per model and schema hash (so the weights
that made a bank are the weights that read it):

    nextstep:{banks:<model>:<schema>}:bank:<version>   HASH  <head>_<part> -> the .npy file's bytes
    nextstep:{banks:<model>:<schema>}:versions         HASH  <version> -> provenance.json (listed = complete)
    nextstep:{banks:<model>:<schema>}:active           STRING  the active version

Bank versions are immutable (`nextstep banks build` refuses an existing one). At startup and reload every
version found in the artifact is published if absent, and the pointer is set to the manifest's default if
there is none, so replicas sharing one Redis agree on the active version; `InProcessBankStore` does the same
in memory when no Redis is configured.

Per process, `Banks` keeps (model, version) -> the projected keys and values (`bank_project` runs once per
version) and the version it serves. Which version is active is re-read from the store at most every
`refresh_seconds` (NEXTSTEP_BANK_REFRESH_SECONDS, 1 s), by the one request that finds it stale: one round
trip a second per model instead of one per request, and no change to the state read every other task
shares; the price is that a swap made through another replica is seen within `refresh_seconds`. A swap
(`activate`) and a refresh load and project the new version before they switch to it; a request takes the
bank once when it starts and keeps it to the end, so requests in flight finish with the bank they began with.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import io
import json
import logging
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import StoreUnavailable
from ..registry import LoadedModel

if TYPE_CHECKING:
    from ..redis_clients import RedisOptions

log = logging.getLogger(__name__)
PARTS = ("states", "lengths", "summaries", "sizes")  # the files of one head's bank (nextstep/training/kt/banks.py)
PROVENANCE = ("created", "data_file", "n_trajectories", "n_students", "seed", "model_weights_sha256")


@dataclass(eq=False)
class Bank:
    """One projected bank version: what the step and predict graphs take, and what an explanation names."""

    version: str
    kv: dict[str, np.ndarray]  # bank_<head>_keys / _values, (L, M, d_head), and the answer heads' parts, read-only
    entries: dict[str, list[dict]]  # per head, per entry: {"type": "cluster", "members": n} or {"type": "knn",
    # "student": training student id}

    @functools.cached_property
    def tag(self) -> bytes:
        """8 bytes naming the version in a learner's stored state (kt.py): BLAKE2b-64 of its name."""
        return hashlib.blake2b(self.version.encode(), digest_size=8).digest()


class InProcessBankStore:
    """The bank store in memory (no Redis configured): the same operations as `RedisBankStore`."""

    def __init__(self) -> None:
        self._spaces: dict[str, dict] = {}

    def _space(self, space: str) -> dict:
        return self._spaces.setdefault(space, {"active": None, "versions": {}, "banks": {}})

    async def versions(self, space: str) -> tuple[str | None, dict[str, bytes]]:
        s = self._space(space)
        return s["active"], dict(s["versions"])

    async def publish(self, space: str, version: str, fields: dict[str, bytes], provenance: bytes) -> None:
        s = self._space(space)
        if version not in s["versions"]:
            s["banks"][version], s["versions"][version] = dict(fields), provenance

    async def fetch(self, space: str, version: str, names: list[str]) -> tuple[list[bytes | None], bytes | None]:
        s = self._space(space)
        return [s["banks"].get(version, {}).get(n) for n in names], s["versions"].get(version)

    async def init_active(self, space: str, default: str | None) -> str | None:
        s = self._space(space)
        if s["active"] is None:
            s["active"] = default
        return s["active"]

    async def active(self, space: str) -> str | None:
        return self._space(space)["active"]

    async def set_active(self, space: str, version: str) -> None:
        self._space(space)["active"] = version

    async def close(self) -> None:
        return None


class RedisBankStore:
    """Banks in Redis (module docstring), through a client of their own (redis_clients.py, the same kinds as the
    state stores'): a bank is megabytes, and must not hold up the state reads pipelined on the state stores'
    connection; hence also the longer timeout. Every key of one model's banks shares a hash tag (one cluster
    slot), so a publish is one transaction on a cluster too."""

    def __init__(self, url: str, *, socket_timeout: float = 5.0, key_prefix: str = "nextstep",
                 options: RedisOptions | None = None) -> None:
        from ..redis_clients import RedisOptions, connect  # (here: no Redis client at import, offline scoring)

        options = replace(options or RedisOptions(), socket_timeout=socket_timeout,
                          connect_timeout=max(socket_timeout, (options or RedisOptions()).connect_timeout))
        self.client, self._prefix = connect(url, options, role="banks"), key_prefix
        self._execute = self.client.execute

    def _key(self, space: str, what: str) -> str:
        return f"{self._prefix}:{{{space}}}:{what}"

    async def close(self) -> None:
        await self.client.close()

    async def versions(self, space: str) -> tuple[str | None, dict[str, bytes]]:
        active, listing = await self._execute("bank versions", (("GET", self._key(space, "active")),
                                                                ("HGETALL", self._key(space, "versions"))))
        listing = dict(zip(listing[::2], listing[1::2], strict=True)) if isinstance(listing, list) else listing
        return (active.decode() if active is not None else None), {v.decode(): p for v, p in listing.items()}

    async def publish(self, space: str, version: str, fields: dict[str, bytes], provenance: bytes) -> None:
        """Write a version if absent: its arrays and its listing entry in one transaction, so a listed version
        is complete. (Two replicas publishing the same immutable version at once write the same bytes, so the
        call may be retried.)"""
        listed = self._key(space, "versions")
        (exists,) = await self._execute("bank publish", (("HEXISTS", listed, version),))
        if not exists:
            pairs = [part for name, value in fields.items() for part in (name, value)]
            await self._execute("bank publish", (("HSET", self._key(space, f"bank:{version}"), *pairs),
                                                 ("HSET", listed, version, provenance)), atomic=True, write=True)

    async def fetch(self, space: str, version: str, names: list[str]) -> tuple[list[bytes | None], bytes | None]:
        """(the named fields of a version, its provenance); None where absent."""
        values, provenance = await self._execute("bank fetch",
                                                 (("HMGET", self._key(space, f"bank:{version}"), *names),
                                                  ("HGET", self._key(space, "versions"), version)))
        return values, provenance

    async def init_active(self, space: str, default: str | None) -> str | None:
        key = self._key(space, "active")
        if default:
            await self._execute("bank pointer", (("SET", key, default, "NX"),), write=True)
        (active,) = await self._execute("bank pointer", (("GET", key),))
        return active.decode() if active is not None else None

    async def active(self, space: str) -> str | None:
        (active,) = await self._execute("bank pointer", (("GET", self._key(space, "active")),))
        return active.decode() if active is not None else None

    async def set_active(self, space: str, version: str) -> None:
        await self._execute("bank pointer", (("SET", self._key(space, "active"), version),), write=True)


def make_bank_store(redis_url: str | None, options: RedisOptions | None = None
                    ) -> InProcessBankStore | RedisBankStore:
    return RedisBankStore(redis_url, options=options) if redis_url else InProcessBankStore()


def read_version(model: LoadedModel, folder: Path) -> tuple[dict[str, bytes], bytes]:
    """A bank version's files as store fields, checked against the model's bank_project graph (ValueError)."""
    provenance = (folder / "provenance.json").read_bytes()
    by_head = {e["head"]: e for e in json.loads(provenance)["banks"]}
    fields = {}
    graph = {i.name: i for i in model.sessions["predict"].get_inputs()}
    for name in model.extra.banks["answer_inputs"]:  # bank_<head>_<part>: kept as built, checked against predict
        head, part = _answer_part(model, name)
        if head not in by_head:
            raise ValueError(f"{folder}: no bank for answer head {head!r}")
        fields[name.removeprefix("bank_")] = (folder / by_head[head]["files"][part]).read_bytes()
        array = np.load(io.BytesIO(fields[name.removeprefix("bank_")]), allow_pickle=False)
        want = graph[name].shape if name in graph else None
        dtype = {"tensor(float)": np.float32, "tensor(int64)": np.int64}.get(graph[name].type) if want else None
        if want is None or array.dtype != dtype or array.ndim != len(want) \
                or any(isinstance(w, int) and w != n for w, n in zip(want, array.shape, strict=True)):
            raise ValueError(f"{folder}: answer bank part {name} is {array.dtype}{list(array.shape)}; the predict "
                             f"graph takes {graph[name].type if want else None} {want}")
    if model.extra.banks["heads"]:
        shapes = {i.name: i.shape for i in model.sessions["bank_project"].get_inputs()}
    for head in model.extra.banks["heads"]:
        if head not in by_head:
            raise ValueError(f"{folder}: no bank for inter-student head {head!r}")
        files = by_head[head].get("files", {})
        for part in PARTS:
            fields[f"{head}_{part}"] = (folder / files.get(part, f"{head}_{part}.npy")).read_bytes()
        states, lengths = (np.load(io.BytesIO(fields[f"{head}_{p}"]), allow_pickle=False) for p in PARTS[:2])
        want = shapes[f"bank_{head}_states"]
        if states.dtype != np.float32 or states.ndim != 3 or lengths.shape != states.shape[:1] \
                or any(isinstance(w, int) and w != n for w, n in zip(want, states.shape, strict=True)):
            raise ValueError(f"{folder}: bank {head!r} is {states.dtype}{list(states.shape)} with lengths "
                             f"{list(lengths.shape)}; the model takes float32 {want}")
    return fields, provenance


def _answer_part(model: LoadedModel, name: str) -> tuple[str, str]:
    """(head, part) of an answer head's input bank_<head>_<part> (head names may hold '_')."""
    head = next(h for h in model.extra.banks["answer_heads"] if name.startswith(f"bank_{h}_"))
    return head, name.removeprefix(f"bank_{head}_")


def field_names(model: LoadedModel) -> list[str]:
    """The store fields a version's load reads: block 3's states, lengths and sizes, the answer heads' parts."""
    return [f"{h}_{p}" for h in model.extra.banks["heads"] for p in ("states", "lengths", "sizes")] \
        + [n.removeprefix("bank_") for n in model.extra.banks["answer_inputs"]]


def project(model: LoadedModel, version: str, values: list[bytes], provenance: bytes) -> Bank:
    """Run bank_project on one version's arrays (in a worker thread: it is the costly part of a swap)."""
    section = model.extra.banks
    heads = section["heads"]
    arrays = dict(zip(field_names(model), (np.load(io.BytesIO(v), allow_pickle=False) for v in values), strict=True))
    feeds = {f"bank_{h}_{p}": arrays[f"{h}_{p}"] for h in heads for p in ("states", "lengths")}
    kv = dict(zip(section["keys"], model.sessions["bank_project"].run(None, feeds), strict=True)) if heads else {}
    kv.update({n: arrays[n.removeprefix("bank_")] for n in section["answer_inputs"]})
    for value in kv.values():
        value.flags.writeable = False
    by_head = {e["head"]: e for e in json.loads(provenance)["banks"]}
    entries = {}
    for h in heads:
        kind, sources = by_head[h]["type"], by_head[h].get("sources")
        entries[h] = [{"type": kind, "student": sources[i][0] if sources and sources[i] else None}
                      if kind == "knn" else {"type": kind, "members": int(n)}
                      for i, n in enumerate(arrays[f"{h}_sizes"])]
    return Bank(version, kv, entries)


def check_banks(banks, graphs: dict, fail) -> dict | None:
    """The manifest's `banks` section, checked against the graphs (registry.TaskSpec.check's `graphs`); None
    when there is none."""
    input_names = {g: [n for n, _ in inputs] for g, (inputs, _) in graphs.items()}
    output_names = {g: outputs for g, (_, outputs) in graphs.items()}
    if banks is None:
        return None
    try:
        heads, inputs, keys, explain = (list(banks[k]) for k in ("heads", "inputs", "keys", "explain"))
        answer_heads, answer_inputs = list(banks.get("answer_heads", [])), list(banks.get("answer_inputs", []))
        default, folder = banks.get("default"), str(banks["dir"])
    except (KeyError, TypeError) as e:
        raise fail(f"manifest banks {banks!r} lacks or mangles {e}") from None
    if heads and (input_names.get("bank_project") != inputs or output_names.get("bank_project") != keys):
        raise fail(f"bank_project graph takes {input_names.get('bank_project')} and outputs "
                   f"{output_names.get('bank_project')}; manifest banks say {inputs} -> {keys}")
    if (heads or answer_heads) and default is not None and not isinstance(default, str):
        raise fail(f"manifest banks.default {default!r} is not a version name")
    if any(not any(n.startswith(f"bank_{h}_") for h in answer_heads) for n in answer_inputs):
        raise fail(f"manifest banks.answer_inputs {answer_inputs} are not all bank_<answer head>_<part>")
    for g in ("predict", "step_predict"):
        if not set(keys + answer_inputs) <= set(input_names[g]) or not set(explain) <= set(output_names[g]):
            raise fail(f"{g} graph does not take the bank tensors {keys + answer_inputs} or output {explain}")
    if heads:  # a learner's state is folded with a bank: step reads it, rebase re-folds a state with another
        for g in ("step", "rebase"):
            if not set(keys) <= set(input_names.get(g, ())):
                raise fail(f"{g} graph {'missing' if g not in input_names else 'does not take the bank tensors'}: "
                           f"an artifact from before cached SimAKT states? re-export it (nextstep export)")
    return {"heads": heads, "inputs": inputs, "keys": keys, "explain": explain, "answer_heads": answer_heads,
            "answer_inputs": answer_inputs, "default": default, "dir": folder}


@dataclass(eq=False)
class _Served:
    """One model's banks in this process."""

    space: str
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # publishing and loading (rare); never per request
    loaded: dict[str, Bank] = field(default_factory=dict)
    active: str | None = None  # the version this process serves
    ready: bool = False  # published and the pointer read
    next_check: float = 0.0  # time.monotonic() after which the pointer is re-read
    checking: bool = False
    swaps: int = 0  # activate() calls: a pointer read that began before one is stale


class Banks:
    def __init__(self, store: InProcessBankStore | RedisBankStore, *, refresh_seconds: float = 1.0):
        self.store, self.refresh = store, refresh_seconds
        self._served: weakref.WeakKeyDictionary[LoadedModel, _Served] = weakref.WeakKeyDictionary()

    @staticmethod
    def uses_banks(model: LoadedModel) -> bool:
        banks = getattr(model.extra, "banks", None)  # (knowledge tracing's; the other tasks' models have none)
        return bool(banks and (banks["heads"] or banks["answer_heads"]))

    async def prepare(self, models: list[LoadedModel]) -> None:
        """Publish the banks of every model that has some and load each one's active version (startup, reload);
        a failure is logged and that model tries again on its first request."""
        for model in models:
            if self.uses_banks(model):
                try:
                    await self._ready(model)
                except StoreUnavailable as exc:  # (the client logs the outage itself, with the address)
                    log.warning("memory banks of %s/%s not ready: %s", model.name, model.version, exc)
                except Exception:  # the other models serve; this one's requests fail, naming the fault
                    log.exception("memory banks of %s/%s not ready", model.name, model.version)

    async def current(self, model: LoadedModel) -> Bank | None:
        """The bank a request of this model uses (None for a model without banks)."""
        if not self.uses_banks(model):
            return None
        served = await self._ready(model)
        if time.monotonic() >= served.next_check and not served.checking:
            served.checking, swaps = True, served.swaps
            try:
                version = await self.store.active(served.space)
                if version and version != served.active and swaps == served.swaps:
                    await self._bank(model, served, version)  # loaded before this process switches to it
                    if swaps == served.swaps:
                        served.active = version
            except StoreUnavailable:  # keep serving the bank this process has; try again after the interval (the
                pass  # client logs Redis outages once, not every interval: redis_clients.Health)
            except Exception:  # (a fault of the version read: the log has it each interval, as a request would)
                log.exception("active bank version of %s/%s not followed", model.name, model.version)
            finally:
                served.checking, served.next_check = False, time.monotonic() + self.refresh
        return await self._bank(model, served, served.active)

    async def versions(self, model: LoadedModel) -> dict:
        served = await self._ready(model)
        active, listing = await self.store.versions(served.space)
        out = []
        for version, provenance in sorted(listing.items()):
            prov = json.loads(provenance)
            out.append({"version": version, "loaded": version in served.loaded,
                        "heads": {e["head"]: {"type": e["type"], "entries": e["entries"],
                                              "students": e.get("students")} for e in prov["banks"]},
                        "provenance": {k: prov[k] for k in PROVENANCE if k in prov}})
        return {"active": active, "serving": served.active, "versions": out}

    async def activate(self, model: LoadedModel, version: str) -> str | None:
        """Load and project `version`, then move the pointer to it; returns the version served before."""
        served = await self._ready(model)
        await self._bank(model, served, version)
        await self.store.set_active(served.space, version)
        previous, served.active = served.active, version
        served.swaps += 1
        served.next_check = time.monotonic() + self.refresh
        return previous

    async def _ready(self, model: LoadedModel) -> _Served:
        served = self._served.get(model)
        if served is None:
            served = self._served.setdefault(model, _Served(f"banks:{model.name}:{model.schema}"))
        if not served.ready:
            async with served.lock:
                if not served.ready:
                    await self._publish(model, served)
        return served

    async def _publish(self, model: LoadedModel, served: _Served) -> None:
        """Every version in the artifact into the store if absent; the pointer to the default if none; load it."""
        _, listing = await self.store.versions(served.space)
        root = model.path / model.extra.banks["dir"]
        folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) \
            if root.is_dir() else []
        for folder in folders:
            if folder.name in listing:
                continue
            try:
                fields, provenance = await asyncio.to_thread(read_version, model, folder)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.error("bank version %s of %s/%s not published: %s", folder.name, model.name, model.version, exc)
                continue
            await self.store.publish(served.space, folder.name, fields, provenance)
            listing[folder.name] = provenance
        default = model.extra.banks["default"]
        active = await self.store.init_active(served.space, default if default in listing else None)
        if active is None:
            raise ValueError(f"no usable bank version in {root} (default {default!r})")
        served.loaded[active] = await self._load(model, served, active)
        served.active, served.ready = active, True
        served.next_check = time.monotonic() + self.refresh

    async def _bank(self, model: LoadedModel, served: _Served, version: str) -> Bank:
        bank = served.loaded.get(version)
        if bank is None:
            async with served.lock:  # one load per version; requests meanwhile keep the bank they hold
                bank = served.loaded.get(version)
                if bank is None:
                    bank = served.loaded[version] = await self._load(model, served, version)
        return bank

    async def _load(self, model: LoadedModel, served: _Served, version: str) -> Bank:
        values, provenance = await self.store.fetch(served.space, version, field_names(model))
        if provenance is None or any(v is None for v in values):
            raise StoreUnavailable(f"bank version {version!r} of model {model.name} is not in the store")
        return await asyncio.to_thread(project, model, version, values, provenance)

    async def close(self) -> None:
        await self.store.close()
