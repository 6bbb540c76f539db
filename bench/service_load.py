"""HTTP load on the real service: `nextstep serve` (one worker) with its state in a real Redis, driven by wrk.

    python bench/service_load.py [--artifact DIR] [--duration 10] [--connections 32] [--json OUT]

Everything runs on this machine and talks to 127.0.0.1 only:

1. the artifact: `--artifact DIR` (one artifact directory holding manifest.json, or an artifacts root holding
   deep_gpcm/<version>/manifest.json); without it, a small synthetic GPCM data set (100 students, 200
   questions, K=4, sequences of 100-200) is generated and deep_gpcm is trained for one epoch (about a
   minute) in a child process, into <tmp>/artifacts/deep_gpcm/bench/;
2. a redis-server on a free loopback port (no RDB, no AOF) and the service as a separate process,
   `nextstep serve --host 127.0.0.1 --port P --artifacts <tmp>/artifacts` with NEXTSTEP_REDIS_URL set;
   the script waits for GET /readyz and stops both processes (by pid) when it ends, also on errors;
3. wrk (Lua scripts written to the temp dir) on POST /v1/kt/deep_gpcm/events, one event and one
   predict_question_ids entry per request, unique event ids, a rotating question id, students kept per
   wrk thread so their states keep evolving: (a) one connection (-t1 -c1), (b) --connections
   connections (-t2), (c) GET /healthz at --connections connections, for the events / healthz ratio;
4. the stateless alternative: POST /v1/kt/deep_gpcm/batch with one student's whole 200-event history and
   the same single prediction, over one connection (httpx, at least 50 timed requests); before that the
   same 200 events are sent one per request to /events, and the two final predictions are compared;
5. the bytes Redis holds per student (MEMORY USAGE of the state hash and of its replay window, the blob
   size);
6. a summary against the issue's targets.

Requires wrk (Debian/Ubuntu: apt-get install wrk) and redis-server on PATH; installs nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import string
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from machine import machine  # bench/machine.py (the script's directory is on sys.path)

MODEL = "deep_gpcm"
HISTORY = 200  # events in the stateless request (and in the parity student)
TARGETS = {  # the targets
    "c1_p50_ms": 1.0,
    "c1_p99_ms": 3.0,
    "cN_rps": 1000.0,
    "events_over_healthz": 0.5,
    "stateful_speedup": 20.0,
}
TRAIN_SCRIPT = """
import sys
from nextstep.training.loop import TrainConfig
from nextstep.training.kt.run import train_model
from nextstep.training.kt.synthetic import write_gpcm_dataset
data, out = sys.argv[1], sys.argv[2]
write_gpcm_dataset(data, n_students=100, n_questions=200, seq_len_range=(100, 200), seed=42)
train_model("deep_gpcm", data, out, cfg=TrainConfig(epochs=1), progress=False, log=False)
"""


class BenchError(RuntimeError):
    """A failure the script explains itself (printed without a traceback)."""


# -- machine -----------------------------------------------------------------------------------------
def machine_info() -> dict:
    info = machine()
    cpu, usable, load = info["cpu"], info["usable_cpus"], info["load_avg"]
    wrk_version = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["wrk", "--version"], capture_output=True, text=True, timeout=10)
        wrk_version = (out.stdout + out.stderr).splitlines()[0].split(" Copyright")[0].strip()
    redis_version = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError):
        out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True, timeout=10)
        redis_version = out.stdout.split()[2].removeprefix("v=")
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "usable_cpus": usable, "load_avg_at_start": load,
            "platform": platform.platform(), "python": platform.python_version(), "wrk": wrk_version,
            "redis": redis_version}


def cpu_seconds(pid: int) -> dict[str, float] | None:
    """CPU seconds (user + system) used so far by a process: in all, and by its first thread (for the
    service: the event loop) apart from its other threads. None where /proc is not available."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def read(path: Path) -> float:
        fields = path.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime (fields 14 and 15 of stat)

    try:
        return {"total": read(Path(f"/proc/{pid}/stat")), "main": read(Path(f"/proc/{pid}/task/{pid}/stat"))}
    except (OSError, IndexError, ValueError):
        return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- processes ---------------------------------------------------------------------------------------
class Processes:
    """Child processes this script started; stopped by pid (TERM, then KILL) in reverse order."""

    def __init__(self):
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], log_path: Path, **kwargs) -> subprocess.Popen:
        log = open(log_path, "wb")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **kwargs)
        proc._bench_log = log  # type: ignore[attr-defined]
        self.procs.append((name, proc))
        return proc

    def stop_all(self) -> None:
        while self.procs:
            name, proc = self.procs.pop()
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                    proc.wait(timeout=10)
            proc._bench_log.close()  # type: ignore[attr-defined]


def tail(path: Path, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return "(no log)"


def start_redis(procs: Processes, work: Path) -> tuple[int, subprocess.Popen]:
    import redis

    port = free_port()
    argv = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
            "--protected-mode", "yes", "--daemonize", "no", "--dir", str(work)]
    log = work / "redis.log"
    proc = procs.start("redis-server", argv, log)
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
    deadline = time.monotonic() + 15
    while True:
        if proc.poll() is not None:
            raise BenchError(f"redis-server exited with {proc.returncode}:\n{tail(log)}")
        with contextlib.suppress(redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            if client.ping():
                break
        if time.monotonic() > deadline:
            raise BenchError(f"redis-server did not answer PING within 15 s:\n{tail(log)}")
        time.sleep(0.05)
    client.close()
    return port, proc


def start_service(procs: Processes, work: Path, artifacts: Path, redis_port: int) -> tuple[str, subprocess.Popen]:
    import httpx

    port = free_port()
    exe = shutil.which("nextstep")
    argv = [exe] if exe else [sys.executable, "-m", "nextstep.cli"]
    argv += ["serve", "--host", "127.0.0.1", "--port", str(port), "--artifacts", str(artifacts)]
    env = dict(os.environ)
    env["NEXTSTEP_REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
    env["NEXTSTEP_ARTIFACTS_DIR"] = str(artifacts)
    env["NEXTSTEP_API_KEYS"] = ""  # no authentication in the benchmark
    log = work / "service.log"
    # cwd: the temp dir, so that no .env file of the caller's working directory changes the settings
    proc = procs.start("nextstep serve", argv, log, env=env, cwd=work)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    last = ""
    with httpx.Client(base_url=base, timeout=2.0) as client:
        while True:
            if proc.poll() is not None:
                raise BenchError(f"nextstep serve exited with {proc.returncode}:\n{tail(log)}")
            try:
                r = client.get("/readyz")
                if r.status_code == 200:
                    break
                last = f"{r.status_code} {r.text}"
            except httpx.TransportError as e:
                last = repr(e)
            if time.monotonic() > deadline:
                raise BenchError(f"/readyz not ready within 120 s (last answer: {last}):\n{tail(log)}")
            time.sleep(0.1)
    return base, proc


# -- the artifact ------------------------------------------------------------------------------------
def prepare_artifacts(given: str | None, work: Path) -> tuple[Path, Path, str]:
    """(artifacts root to serve, the deep_gpcm artifact dir, how it was obtained)."""
    root = work / "artifacts"
    if given:
        src = Path(given).resolve()
        if (src / "manifest.json").is_file():
            (root / MODEL).mkdir(parents=True)
            link = root / MODEL / (src.name if not src.name.startswith(".") else "given")
            link.symlink_to(src, target_is_directory=True)
            return root, link, f"given: {src}"
        found = [m.parent for m in (src / MODEL).glob("*/manifest.json") if not m.parent.name.startswith(".")]
        if found:  # the version the service calls latest: newest `created`, then the directory name
            latest = max(found, key=lambda d: (str(json.loads((d / "manifest.json").read_text()).get("created")),
                                               d.name))
            return src, latest, f"given artifacts root: {src} ({MODEL}/{latest.name})"
        raise BenchError(f"--artifact {given}: neither an artifact directory (manifest.json) nor an artifacts "
                         f"root holding {MODEL}/<version>/manifest.json")
    out = root / MODEL / "bench"
    print("building the artifact: synthetic GPCM data (100 students, 200 questions, K=4) and deep_gpcm trained "
          "for 1 epoch ...", flush=True)
    started = time.perf_counter()
    log = work / "train.log"
    with open(log, "wb") as sink:
        try:
            done = subprocess.run([sys.executable, "-c", TRAIN_SCRIPT, str(work / "data"), str(out)],
                                  stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=900)
        except subprocess.TimeoutExpired:
            raise BenchError(f"training did not finish within 900 s:\n{tail(log)}") from None
    if done.returncode != 0 or not (out / "manifest.json").is_file():
        raise BenchError(f"training failed (exit {done.returncode}):\n{tail(log)}")
    took = time.perf_counter() - started
    print(f"  trained and exported in {took:.0f} s", flush=True)
    return root, out, f"built: synthetic data, deep_gpcm 1 epoch ({took:.0f} s)"


def artifact_vocab(art: Path) -> tuple[list[str], int]:
    manifest = json.loads((art / "manifest.json").read_text())
    vocab = json.loads((art / manifest["vocabularies"]["questions"]).read_text())["ids"]
    return [str(q) for q in vocab], int(manifest["responses"]["n_cats"])


# -- wrk ---------------------------------------------------------------------------------------------
LUA_DONE = r"""
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCH {"requests":%d,"duration_us":%d,"bytes":%d,"p50_us":%.0f,"p90_us":%.0f,"p99_us":%.0f,' ..
    '"max_us":%.0f,"mean_us":%.1f,"connect_errors":%d,"read_errors":%d,"write_errors":%d,' ..
    '"status_errors":%d,"timeouts":%d}\n',
    summary.requests, summary.duration, summary.bytes, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max, latency.mean, e.connect, e.read, e.write, e.status, e.timeout))
end
"""


# Numbers wrk's threads 0, 1, ... as the global `tid` of each (set in the main Lua state before the
# threads start; a script's init reads it as `tid or 0`). Substituted for $threads in every bench's script.
LUA_THREADS = """\
local threads = {}
function setup(thread)
  thread:set("tid", #threads)
  table.insert(threads, thread)
end"""


def run_in_tempdir(run, args, prefix: str, needs: tuple[str, ...] = ()) -> int:
    """run(args, work_dir, procs) in a fresh temporary directory; a BenchError is printed and gives exit
    status 1; every process the run started is stopped whatever happens. A program in `needs` missing from PATH
    is exit status 2, said in one line."""
    missing = [name for name in needs if shutil.which(name) is None]
    if missing:
        print(f"{Path(sys.argv[0]).name} needs {', '.join(missing)} on PATH", file=sys.stderr)
        return 2
    procs = Processes()
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        try:
            return run(args, Path(tmp), procs)
        except BenchError as exc:
            print(f"benchmark failed: {exc}", file=sys.stderr)
            return 1
        finally:
            procs.stop_all()


def lua_string(text: str) -> str:
    level = 0
    while f"]{'=' * level}]" in text:
        level += 1
    return f"[{'=' * level}[{text}]{'=' * level}]"


EVENTS_LUA = string.Template("""\
-- generated by bench/service_load.py: POST /events, one event + one prediction per request
local Q = {
  $questions
}
local NQ = #Q
local K = $n_cats
local TAG = $tag
local POOL = $pool  -- students per wrk thread, taken in turn
local PATH = "/v1/kt/$model/events"
local HEADERS = {["Content-Type"] = "application/json"}
local n = 0
$threads

function init(args)
  tid = tid or 0
  prefix = TAG .. "-" .. (args[1] or "") .. "-t" .. tid  -- (args[1]: run_wrk's run id)
end

function request()
  n = n + 1
  local s = (n - 1) % POOL                              -- this thread's students, in turn
  local round = math.floor((n - 1) / POOL)             -- events this student has had from this thread
  local qi = (round * 7 + s * 13 + tid * 29) % NQ + 1  -- rotating question
  local pi = qi % NQ + 1                               -- predict the next question
  local r = (round * 5 + s * 3 + tid) % K              -- a response pattern that keeps changing
  local body = '{"student_id":"' .. prefix .. '-s' .. s .. '","events":[{"question_id":' .. Q[qi] ..
    ',"response":' .. r .. ',"event_id":"' .. prefix .. '-' .. n .. '"}],"predict_question_ids":[' ..
    Q[pi] .. ']}'
  return wrk.format("POST", PATH, HEADERS, body)
end
""")


def events_lua(question_ids: list[str], n_cats: int, tag: str, students_per_thread: int) -> str:
    """wrk script: POST /events, one event + one prediction, students round-robin within each thread."""
    questions = ",\n  ".join(lua_string(json.dumps(qid)) for qid in question_ids)
    return EVENTS_LUA.substitute(questions=questions, n_cats=n_cats, tag=lua_string(tag),
                                 pool=students_per_thread, model=MODEL, threads=LUA_THREADS) + LUA_DONE


def run_wrk(url: str, script: Path, threads: int, connections: int, duration: float,
            pids: dict[str, int] | None = None) -> dict:
    """One wrk run; the script's init(args) gets a run id of its own as args[1] (a script that makes event ids puts
    it in them: a later run of the same script then sends new events, not replays of the earlier run's)."""
    argv = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{max(1, round(duration))}s", "--latency",
            "--timeout", "5s", "-s", str(script), url, "--", uuid.uuid4().hex[:12]]
    before = {name: cpu_seconds(pid) for name, pid in (pids or {}).items()}
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=duration + 60)
    except subprocess.TimeoutExpired:
        raise BenchError(f"wrk did not finish: {' '.join(argv)}") from None
    after = {name: cpu_seconds(pid) for name, pid in (pids or {}).items()}
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("BENCH ")), None)
    if out.returncode != 0 or line is None:
        raise BenchError(f"wrk failed (exit {out.returncode}): {' '.join(argv)}\n{out.stdout}\n{out.stderr}")
    res = json.loads(line[len("BENCH "):])
    res["rps"] = res["requests"] / (res["duration_us"] / 1e6)
    res["errors"] = sum(res[k] for k in ("connect_errors", "read_errors", "write_errors", "status_errors",
                                         "timeouts"))
    res["command"] = " ".join(["wrk", *argv[1:-5], Path(script).name, url])
    seconds = res["duration_us"] / 1e6
    cpu = {"wrk": (children_after.ru_utime + children_after.ru_stime) - (children.ru_utime + children.ru_stime)}
    for name in after:
        if before[name] is not None and after[name] is not None:
            cpu[name] = after[name]["total"] - before[name]["total"]
            if name == "service":
                cpu["service_event_loop"] = after[name]["main"] - before[name]["main"]
    res["cpu_seconds"] = cpu
    res["cpu_ms_per_request"] = {k: 1000 * v / max(1, res["requests"]) for k, v in cpu.items()}
    res["cpu_cores_busy"] = {k: v / seconds for k, v in cpu.items()}
    res["wrk_output"] = out.stdout
    return res


def no_errors(res: dict) -> dict:
    """`res` (a run_wrk result) when every request was answered with a 2xx; else BenchError: a refused request is no
    measure of the route (for the benches that compare figures rather than print each run)."""
    if res["errors"]:
        raise BenchError(f"{res['errors']} errors or non-2xx answers (non-2xx {res['status_errors']}) in "
                         f"`{res['command']}`:\n{res['wrk_output']}")
    return res


def metrics_snapshot(base: str) -> dict[tuple, float]:
    """The service's Prometheus counters and histogram sums/counts, keyed by (sample name, labels)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith(("_sum", "_count", "_total")):
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def inside_service(before: dict, after: dict, requests: int) -> dict:
    """Where a phase's time went, from the service's own metrics: per-request means in ms."""

    def delta(name: str, **labels) -> float:
        return sum(v - before.get(k, 0.0) for k, v in after.items()
                   if k[0] == name and all(dict(k[1]).get(lk) == lv for lk, lv in labels.items()))

    n = max(1, requests)
    route = "/v1/kt/{model}/events"
    handled = delta("nextstep_request_seconds_count", route=route)
    calls = delta("nextstep_inference_seconds_count")
    out = {
        "handler_ms": 1000 * delta("nextstep_request_seconds_sum", route=route) / max(1, handled),
        "onnxruntime_ms": 1000 * delta("nextstep_inference_seconds_sum") / n,
        "onnxruntime_calls": calls / n,
        "rows_per_onnxruntime_call": delta("nextstep_microbatch_rows_sum") / max(1, calls),
        "cas_retries": delta("nextstep_cas_retries_total"),
    }
    for op in ("read", "compare_and_set"):
        out[f"redis_{op}_ms"] = 1000 * delta("nextstep_state_store_seconds_sum", operation=op) / n
    return out


def show_inside(res: dict) -> None:
    i = res.get("inside")
    if i:
        print(f"  {'':34s} inside the service, mean per request: handler {i['handler_ms']:.3f} ms, of which "
              f"ONNX Runtime {i['onnxruntime_ms']:.3f} ms ({i['rows_per_onnxruntime_call']:.1f} rows/call), "
              f"Redis read (state + seen ids) {i['redis_read_ms']:.3f} + CAS "
              f"{i['redis_compare_and_set_ms']:.3f} ms; CAS retries {i['cas_retries']:.0f}", flush=True)


def show_wrk(label: str, res: dict) -> None:
    errors = f"  ERRORS: {res['errors']} (non-2xx {res['status_errors']}, timeouts {res['timeouts']}, " \
             f"socket {res['connect_errors'] + res['read_errors'] + res['write_errors']})" if res["errors"] else ""
    print(f"  {label:34s} {res['rps']:9.0f} req/s   p50 {res['p50_us'] / 1000:7.3f} ms   "
          f"p90 {res['p90_us'] / 1000:7.3f} ms   p99 {res['p99_us'] / 1000:7.3f} ms   "
          f"max {res['max_us'] / 1000:7.1f} ms   n={res['requests']}{errors}", flush=True)
    per, busy = res["cpu_ms_per_request"], res["cpu_cores_busy"]
    if "service" in per:
        print(f"  {'':34s} CPU per request: service {per['service']:.3f} ms (event loop "
              f"{per.get('service_event_loop', float('nan')):.3f} ms, busy {busy.get('service_event_loop', 0):.0%}), "
              f"redis {per.get('redis', float('nan')):.3f} ms, wrk {per['wrk']:.3f} ms", flush=True)


# -- stateless vs stateful ---------------------------------------------------------------------------
def history(question_ids: list[str], n_cats: int, length: int) -> tuple[list[dict], str]:
    nq = len(question_ids)
    events = [{"question_id": question_ids[(i * 7 + 3) % nq], "response": (i * 5 + i // 3) % n_cats}
              for i in range(length)]
    return events, question_ids[(length * 7 + 3) % nq]


def stateless_vs_stateful(base: str, question_ids: list[str], n_cats: int, n_requests: int,
                          time_cap: float) -> dict:
    import httpx

    events, target = history(question_ids, n_cats, HISTORY)
    batch_body = {"students": [{"student_id": "stateless-0", "events": events, "predict_question_ids": [target]}]}
    with httpx.Client(base_url=base, timeout=30.0) as client:
        # the same history through the stateful path, one event per request; the last asks for the prediction
        student = "parity-0"
        for i, e in enumerate(events):
            body = {"student_id": student, "events": [{**e, "event_id": f"parity-{i}"}]}
            if i == len(events) - 1:
                body["predict_question_ids"] = [target]
            r = client.post(f"/v1/kt/{MODEL}/events", json=body)
            if r.status_code != 200:
                raise BenchError(f"POST /events for the parity student: {r.status_code} {r.text[:500]}")
        stateful = r.json()["predictions"][0]["probabilities"]

        url = f"/v1/kt/{MODEL}/batch"
        payload = json.dumps(batch_body).encode()
        headers = {"content-type": "application/json"}
        for _ in range(3):  # warm-up
            r = client.post(url, content=payload, headers=headers)
            if r.status_code != 200:
                raise BenchError(f"POST /batch: {r.status_code} {r.text[:500]}")
        stateless = r.json()["students"][0]["predictions"][0]["probabilities"]
        times = []
        started = time.perf_counter()
        while len(times) < n_requests and time.perf_counter() - started < time_cap:
            t0 = time.perf_counter()
            r = client.post(url, content=payload, headers=headers)
            times.append(time.perf_counter() - t0)
            if r.status_code != 200:
                raise BenchError(f"POST /batch: {r.status_code} {r.text[:500]}")
    times_ms = sorted(t * 1000 for t in times)
    return {"history": HISTORY, "requests": len(times), "body_bytes": len(payload),
            "p50_ms": statistics.median(times_ms), "p99_ms": times_ms[min(len(times_ms) - 1,
                                                                          math.ceil(0.99 * len(times_ms)) - 1)],
            "mean_ms": statistics.fmean(times_ms), "min_ms": times_ms[0], "max_ms": times_ms[-1],
            "rps": len(times) / sum(times),
            "parity_max_abs_diff": max(abs(a - b) for a, b in zip(stateful, stateless, strict=True)),
            "parity_student": student, "target_question": target}


# -- Redis bytes per student -------------------------------------------------------------------------
def student_bytes(redis_port: int, student: str, model: str = MODEL) -> dict | None:
    """Every Redis key of one learner: the meta hash (with the state before November 2026), the version's state
    hash, the event log (since November 2026), the replay window (since issue 37 a ring of one byte per id and
    256 buckets of 6 bytes per id; before, a ring of 8-byte fingerprints and buckets of them, and before that a
    sorted set)."""
    import redis

    r = redis.Redis(host="127.0.0.1", port=redis_port, socket_timeout=5)
    try:
        keys = sorted(r.scan_iter(match=f"nextstep:{{kt:{model}:*{student}}}*", count=1000))
        if not keys:
            return None
        sizes = {k.decode(): r.memory_usage(k, samples=0) or 0 for k in keys}
        part = {"ids_bytes": (":seen", ":order", ":ids", ":ring"), "log_bytes": (":log",)}
        out = {name: sum(v for k, v in sizes.items() if k.endswith(ends)) for name, ends in part.items()}
        states = [k for k in keys if r.type(k) == b"hash" and r.hexists(k, "blob")]
        order = next((k for k in keys if k.endswith(b":order")), None)  # one byte per id
        ring = next((k for k in keys if k.endswith(b":ring")), None)  # (the layout before: 8 bytes per id)
        return {"student": student, "keys": sorted(sizes), "blob_bytes": r.hstrlen(states[0], "blob") if states else 0,
                "hash_bytes": sum(sizes.values()) - out["ids_bytes"] - out["log_bytes"], **out,
                "event_ids": r.strlen(order) if order else r.strlen(ring) // 8 if ring else 0,
                "events": int(r.hget(states[0], "events") or 0) if states else 0, "total_bytes": sum(sizes.values())}
    finally:
        r.close()


def redis_totals(redis_port: int) -> dict:
    import redis

    r = redis.Redis(host="127.0.0.1", port=redis_port, socket_timeout=5)
    try:
        return {"keys": r.dbsize(), "used_memory": r.info("memory")["used_memory"]}
    finally:
        r.close()


# -- main --------------------------------------------------------------------------------------------
def verdict(ok: bool) -> str:
    return "MET" if ok else "NOT MET"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", help="deep_gpcm artifact directory, or an artifacts root; default: build one")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per wrk measurement (default 10)")
    parser.add_argument("--connections", type=int, default=32, help="connections for the loaded runs (default 32)")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of untimed load first (default 2)")
    parser.add_argument("--stateless-requests", type=int, default=50, help="timed /batch requests (default 50)")
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args(argv)
    if args.connections < 2:
        parser.error("--connections must be >= 2 (the loaded runs use two wrk threads)")
    if not 1 <= args.duration <= 300:
        parser.error("--duration must be within 1..300 seconds")

    missing = [tool for tool in ("wrk", "redis-server") if shutil.which(tool) is None]
    if missing:
        hint = {"wrk": "wrk (Debian/Ubuntu: sudo apt-get install wrk; macOS: brew install wrk)",
                "redis-server": "redis-server (Debian/Ubuntu: sudo apt-get install redis-server)"}
        print("bench/service_load.py needs " + " and ".join(hint[t] for t in missing) + " on PATH.", file=sys.stderr)
        return 2

    machine = machine_info()  # load average before anything starts
    load1 = machine["load_avg_at_start"][0] if machine["load_avg_at_start"] else None
    print(f"machine: {machine['cpu']}, {machine['usable_cpus']} usable cores ({machine['cpu_count']} online), "
          f"load average {machine['load_avg_at_start']} before start")
    print(f"         python {machine['python']}, {machine['wrk']}, redis {machine['redis']}")
    if load1 is not None and load1 >= 0.5:
        print(f"NOTE: load average {load1} >= 0.5: other work is using the CPU; expect slower, noisier numbers.")
    print("NOTE: wrk, redis-server and the service share these cores; the service runs one worker process.")
    inherited = sorted(k for k in os.environ if k.startswith("NEXTSTEP_")
                       and k not in ("NEXTSTEP_REDIS_URL", "NEXTSTEP_ARTIFACTS_DIR", "NEXTSTEP_API_KEYS"))
    if inherited:
        print(f"NOTE: service settings inherited from the environment: {', '.join(inherited)}")

    # stop the children on SIGTERM / SIGHUP too (SIGINT already raises KeyboardInterrupt)
    def _terminate(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)

    procs = Processes()
    results: dict = {"machine": machine, "settings": vars(args), "targets": TARGETS}
    wall = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="nextstep-service-load-") as tmp:
            work = Path(tmp)
            try:
                return run(args, work, procs, results, wall)
            finally:
                procs.stop_all()
    except BenchError as e:
        print(f"\nFAILED: {e}", file=sys.stderr)
        return 1


def run(args, work: Path, procs: Processes, results: dict, wall: float) -> int:
    artifacts, art, origin = prepare_artifacts(args.artifact, work)
    question_ids, n_cats = artifact_vocab(art)
    results["artifact"] = {"origin": origin, "questions": len(question_ids), "n_cats": n_cats}
    print(f"artifact: {origin}; {len(question_ids)} questions, K={n_cats}")

    redis_port, redis_proc = start_redis(procs, work)
    t0 = time.perf_counter()
    base, service_proc = start_service(procs, work, artifacts, redis_port)
    pids = {"service": service_proc.pid, "redis": redis_proc.pid}
    print(f"redis-server on 127.0.0.1:{redis_port} (no persistence); service on {base}, ready in "
          f"{time.perf_counter() - t0:.1f} s (one worker)", flush=True)

    # one request by hand: the route answers 200 with a prediction
    import httpx

    with httpx.Client(base_url=base, timeout=10.0) as client:
        probe = {"student_id": "probe", "events": [{"question_id": question_ids[0], "response": 1,
                                                    "event_id": "probe-1"}],
                 "predict_question_ids": [question_ids[1]]}
        r = client.post(f"/v1/kt/{MODEL}/events", json=probe)
        if r.status_code != 200 or not r.json().get("predictions"):
            raise BenchError(f"POST /v1/kt/{MODEL}/events answered {r.status_code}: {r.text[:500]}")

    conns = args.connections
    per_thread = conns // 2
    scripts = {}
    for tag, pool in (("warm", 4 * per_thread), ("c1", 1), ("cN", 4 * per_thread)):
        scripts[tag] = work / f"events_{tag}.lua"
        scripts[tag].write_text(events_lua(question_ids, n_cats, tag, pool))
    scripts["healthz"] = work / "healthz.lua"
    scripts["healthz"].write_text(LUA_DONE)
    events_url, healthz_url = f"{base}/v1/kt/{MODEL}/events", f"{base}/healthz"

    print(f"\nwrk, {args.duration:g} s per run (after {args.warmup:g} s of warm-up at {conns} connections)")
    if args.warmup > 0:
        run_wrk(events_url, scripts["warm"], 2, conns, args.warmup)
    before = metrics_snapshot(base)
    single = run_wrk(events_url, scripts["c1"], 1, 1, args.duration, pids)
    after = metrics_snapshot(base)
    single["inside"] = inside_service(before, after, single["requests"])
    show_wrk("POST events, 1 connection", single)
    show_inside(single)
    loaded = run_wrk(events_url, scripts["cN"], 2, conns, args.duration, pids)
    single_after, after = after, metrics_snapshot(base)
    loaded["inside"] = inside_service(single_after, after, loaded["requests"])
    show_wrk(f"POST events, {conns} connections", loaded)
    show_inside(loaded)
    health = run_wrk(healthz_url, scripts["healthz"], 2, conns, args.duration, pids)
    show_wrk(f"GET healthz, {conns} connections", health)
    ratio = loaded["rps"] / health["rps"]
    print(f"  events / healthz throughput at {conns} connections: {ratio:.2f}")
    results["wrk"] = {"events_c1": single, "events_cN": loaded, "healthz_cN": health,
                      "events_over_healthz": ratio}

    print(f"\nstateless: POST /batch with one student's {HISTORY}-event history and one prediction "
          f"(1 connection, httpx)")
    sl = stateless_vs_stateful(base, question_ids, n_cats, args.stateless_requests, time_cap=120.0)
    speedup = sl["p50_ms"] / (single["p50_us"] / 1000)
    print(f"  POST batch ({sl['body_bytes']} B body)       {sl['rps']:9.1f} req/s   p50 {sl['p50_ms']:7.2f} ms   "
          f"p99 {sl['p99_ms']:7.2f} ms   min {sl['min_ms']:.2f} ms   n={sl['requests']}")
    if sl["requests"] < args.stateless_requests:
        print(f"  NOTE: only {sl['requests']} requests fit in the 120 s cap")
    print(f"  same prediction through /events ({HISTORY} requests, one event each): max |difference| of "
          f"probabilities {sl['parity_max_abs_diff']:.2e}")
    print(f"  stateful events path is {speedup:.0f}x faster (p50 {single['p50_us'] / 1000:.3f} ms vs "
          f"{sl['p50_ms']:.2f} ms)")
    results["stateless"] = {**sl, "speedup_p50": speedup}

    print("\nbytes in Redis per student")
    students = [("parity-0", f"{HISTORY} events through /events"),
                ("c1-t0-s0", "the 1-connection run's student")]
    stored = []
    for sid, what in students:
        info = student_bytes(redis_port, sid)
        if info is None:
            print(f"  {sid}: no key found")
            continue
        info["what"] = what
        stored.append(info)
        print(f"  {sid:10s} ({what}): {info['events']} events, blob {info['blob_bytes']} B; MEMORY USAGE: "
              f"hashes {info['hash_bytes']} B + event log {info['log_bytes']} B + ids window {info['ids_bytes']} B "
              f"({info['event_ids']} ids) = {info['total_bytes']} B")
    window = None
    if stored:
        big = max(stored, key=lambda s: s["event_ids"])
        if big["event_ids"]:
            per_id = (big["ids_bytes"] + big["log_bytes"]) / big["event_ids"]
            max_ids = int(os.environ.get("NEXTSTEP_MAX_EVENT_IDS", "10000"))
            window = {"bytes_per_event": per_id, "max_event_ids": max_ids,
                      "estimated_total_bytes": big["hash_bytes"] + per_id * max_ids}
            print(f"  keys: {', '.join(big['keys'])}")
            print(f"  the event log and replay window cost about {per_id:.0f} B per event with an id (ids like "
                  f"{big['student']}'s); at {max_ids} events a student holds about "
                  f"{window['estimated_total_bytes'] / 1024:.0f} KiB (estimate; bench/event_log.py measures it)")
    totals = redis_totals(redis_port)
    print(f"  Redis in all: {totals['keys']} keys, used_memory {totals['used_memory'] / 2**20:.1f} MiB")
    results["redis"] = {"students": stored, "full_window": window, "totals": totals}

    # summary
    checks = [
        ("1-connection p50 latency", f"{single['p50_us'] / 1000:.3f} ms", "<= 1.0 ms",
         single["p50_us"] / 1000 <= TARGETS["c1_p50_ms"]),
        ("1-connection p99 latency", f"{single['p99_us'] / 1000:.3f} ms", "<= 3 ms",
         single["p99_us"] / 1000 <= TARGETS["c1_p99_ms"]),
        (f"throughput at {conns} connections", f"{loaded['rps']:.0f} req/s", ">= 1,000 req/s",
         loaded["rps"] >= TARGETS["cN_rps"]),
        ("events / healthz throughput", f"{ratio:.2f}", ">= 0.5", ratio >= TARGETS["events_over_healthz"]),
        ("stateful vs stateless (p50)", f"{speedup:.0f}x", ">= 20x", speedup >= TARGETS["stateful_speedup"]),
    ]
    errors = single["errors"] + loaded["errors"] + health["errors"]
    print("\nsummary (targets from the issue)")
    print(f"  {'measure':34s} {'measured':>14s}  {'target':>15s}  verdict")
    for name, got, want, ok in checks:
        print(f"  {name:34s} {got:>14s}  {want:>15s}  {verdict(ok)}")
    print(f"  also: {conns}-connection events p50 {loaded['p50_us'] / 1000:.2f} ms, p99 "
          f"{loaded['p99_us'] / 1000:.2f} ms; healthz {health['rps']:.0f} req/s; "
          f"{stored[0]['total_bytes'] if stored else '?'} B in Redis per student after {HISTORY} events")
    machine = results["machine"]
    load = machine["load_avg_at_start"]
    print(f"  machine: {machine['usable_cpus']} usable cores, load average {load[0] if load else '?'} "
          f"(1 min) before start; wall time {time.perf_counter() - wall:.0f} s")
    if errors:
        print(f"  WARNING: {errors} wrk errors (non-2xx answers, timeouts or socket errors): the figures above "
              "count them as requests; look at the --json wrk_output")
    results["summary"] = [{"measure": n, "measured": g, "target": w, "met": ok} for n, g, w, ok in checks]
    results["wall_seconds"] = time.perf_counter() - wall
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
        print(f"  wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
