#!/usr/bin/env bash
# `make setup`: the system packages the tests and the service use, then $VENV with nextstep[train,serve,dev,ray,client]
# (versions pinned by constraints.txt) and the torch build that fits the machine.
#
#   system packages  redis-server (the tests start a real one), prometheus (its promtool checks docker/prometheus),
#                    haproxy (tests/service/test_replicas.py runs it in front of three replicas),
#                    python3.X-venv (Debian's python3 cannot create a venv without it). Installed with apt-get
#                    when running as root (or with passwordless sudo); otherwise the exact command is printed.
#   torch            the CPU build unless `nvidia-smi` sees a GPU: from pip's configured sources when they hold it
#                    (e.g. find-links), else from https://download.pytorch.org/whl/cpu. With a GPU: PyPI's build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
CPU_INDEX=https://download.pytorch.org/whl/cpu
started=$SECONDS
say() { echo "setup: $*"; }
export PIP_DISABLE_PIP_VERSION_CHECK=1

# -- 1. system packages ------------------------------------------------------------------------------------
command -v "$PYTHON" >/dev/null || { say "no $PYTHON on PATH: install Python >= 3.11 (or make setup PYTHON=...)"; exit 1; }
py_version=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
unmet=()
apt_install() {  # apt_install PACKAGE...: install with apt-get as root (or passwordless sudo), else say how
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo="sudo -n"; else sudo="none"; fi
  fi
  if command -v apt-get >/dev/null && [ "$sudo" != none ]; then
    say "installing system packages: $*"
    if [ -z "${apt_updated:-}" ]; then $sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq; apt_updated=1; fi
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
  else
    unmet+=("$@")
    say "could not install the system packages $* (needs apt-get and root); run:  sudo apt-get install -y $*"
    return 1
  fi
}
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v promtool >/dev/null || need+=(prometheus)
command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || need+=(haproxy)
[ ${#need[@]} -eq 0 ] || apt_install "${need[@]}" || true

# -- 2. the virtual environment, torch, nextstep ---------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV ($PYTHON $py_version)"
  if ! venv_error=$("$PYTHON" -m venv "$VENV" 2>&1); then
    rm -rf "$VENV"
    case "$venv_error" in
      *ensurepip*)  # Debian's python3 needs python3.X-venv for ensurepip
        apt_install "python$py_version-venv" || { say "$PYTHON cannot create a virtual environment"; exit 1; }
        "$PYTHON" -m venv "$VENV" ;;
      *) say "$PYTHON -m venv $VENV failed:"; echo "$venv_error"; exit 1 ;;
    esac
  fi
fi
pip=("$VENV/bin/python" -m pip install -q -c constraints.txt)
torch_pin=$(sed -n 's/^torch==\([^ #]*\).*/\1/p' constraints.txt)
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  say "NVIDIA GPU found: torch $torch_pin from PyPI (the CUDA build)"
  "${pip[@]}" "torch==$torch_pin"
elif "${pip[@]}" "torch==$torch_pin+cpu" 2>/dev/null; then
  say "no NVIDIA GPU: torch $torch_pin+cpu (from pip's configured sources)"
else
  say "no NVIDIA GPU: torch $torch_pin+cpu from $CPU_INDEX"
  "${pip[@]}" "torch==$torch_pin+cpu" --extra-index-url "$CPU_INDEX"
fi
say "installing nextstep[train,serve,dev,ray,client]"  # ray: nextstep score --engine ray (about 150 MB of wheels, ~10 s)
"${pip[@]}" -e '.[train,serve,dev,ray,client]'

torch_installed=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
say "done in $((SECONDS - started)) s: $VENV (Python $py_version, torch $torch_installed)"
if [ ${#unmet[@]} -gt 0 ]; then
  say "NOT installed: ${unmet[*]} (make test needs them): sudo apt-get install -y ${unmet[*]}"
fi
say "next: make run (serves the demo models on http://127.0.0.1:8000), make test"
