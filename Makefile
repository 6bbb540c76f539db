# NextStep: every command a user or CI needs. `make help` lists them.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
DATA   ?= ../shared/data
# the tests run in one worker process per core (pytest-xdist), each test file whole on one worker, the slowest
# files first (tests/conftest.py); make test WORKERS=0 runs them in this process
WORKERS ?= auto
XDIST   = -n $(WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: help setup run demo demo-artifacts test test-all test-slow test-cluster test-ray lint openapi bench train-synthetic train-assist2009 train-ankimath train-simakt ablation-simakt clean

help:  ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' Makefile | sed 's/:.*## /\t/'

setup:  ## system packages (redis-server, promtool, haproxy; apt-get as root), .venv with nextstep[train,serve,dev,ray,client], CPU torch without a GPU
	PYTHON=$(PYTHON) VENV=$(VENV) scripts/setup.sh

$(BIN)/nextstep:
	@echo "$(VENV) is not set up: run make setup first"; exit 1

PORT ?= 8000
run: $(BIN)/nextstep  ## serve ./artifacts on http://127.0.0.1:8000 (make run PORT=8080: another port; in-process state); the bundled demo models if it is empty
	$(BIN)/nextstep serve --demo --port $(PORT)

demo:  ## train small models on generated data, export them, replay a learner through ONNX Runtime
	$(BIN)/nextstep demo

demo-artifacts:  ## rebuild the demo models bundled in nextstep/demo_artifacts (generated data, fixed seeds; ~40 s)
	OMP_NUM_THREADS=1 $(BIN)/python -m nextstep.demo

test:  ## the fast tier, after every change: lint and every test but the slow and cluster ones
	$(BIN)/ruff check .
	$(BIN)/pytest -m "not slow and not cluster" $(XDIST)

test-all:  ## what CI runs: lint and every test, the slow tier and the Redis Cluster and Sentinel tests included, in one run of the workers (prints the 20 slowest: CI has 30 minutes)
	$(BIN)/ruff check .
	$(BIN)/pytest $(XDIST) --durations=20

test-slow:  ## the slow tier alone (whole training runs, spawned processes, load, fuzzing)
	$(BIN)/pytest -m "slow and not cluster" $(XDIST)

test-cluster:  ## the state stores on a real Redis Cluster (6 servers) and Sentinel, failovers under load (~2 min)
	$(BIN)/pytest -m cluster tests/service/test_cluster.py

test-ray:  ## the Ray Data scoring tests alone (local Ray, 2 CPUs; ~20 s); fails, not skips, without the ray extra
	@$(BIN)/python -c "import ray, pyarrow" 2>/dev/null || { echo "test-ray needs the ray extra: make setup, or $(BIN)/pip install -c constraints.txt -e '.[ray]'"; exit 1; }
	$(BIN)/pytest tests/test_scoring.py

openapi:  ## regenerate openapi/openapi.json from the app (a test fails when it drifts)
	$(BIN)/nextstep openapi

lint:  ## ruff only
	$(BIN)/ruff check .

bench:  ## per-step latency of eager PyTorch, TorchScript and ONNX Runtime (seed sizes, then tuned defaults)
	$(BIN)/python bench/step_latency.py --sizes seed
	$(BIN)/python bench/step_latency.py --sizes default --models deep_gpcm

train-synthetic:  ## the three Deep-GPCM variants on the GPCM synthetic set (artifacts/), configs/*_synthetic.json
	for m in deep_gpcm coral_gpcm attention_gpcm; do \
	  $(BIN)/nextstep train $$m --data $(DATA)/kt/deepgpcm_synthetic_500_200_4 --out artifacts/$$m/synthetic \
	    --config configs/$${m}_synthetic.json || exit 1; \
	done
	$(BIN)/python bench/gpcm_references.py --data $(DATA)/kt/deepgpcm_synthetic_500_200_4

train-assist2009:  ## deep_gpcm on DKVMN's ASSISTments 2009 copy (binary)
	$(BIN)/nextstep train deep_gpcm --data $(DATA)/kt/dkvmn_assist2009_updated --out artifacts/deep_gpcm/assist2009 \
	  --config configs/deep_gpcm_assistments09.json

train-ankimath:  ## time_aware on AnkiMath under the srs-benchmark protocol, FSRS-6 and the other baselines side by side
	$(BIN)/nextstep train time_aware --data $(DATA)/srs/ankimath --duration-cap-s 500 --out artifacts/time_aware/ankimath

train-simakt:  ## SimAKT (dual inter-student heads) on DTransformer's ASSISTments 2009 copy, banks in the artifact
	$(BIN)/nextstep train simakt --data $(DATA)/kt/dtransformer_assist09 --similarity-config configs/simakt/dual.yaml \
	  --out artifacts/simakt/assist09

ablation-simakt:  ## the SimAKT ablation (none / cluster / knn / dual, seeds 0-2) on one data set: hours on 2 cores
	$(BIN)/python -m nextstep.training.kt.simakt_ablation --data $(DATA)/kt/dtransformer_assist09 --out runs/simakt_ablation \
	  --configs configs/simakt/none.json configs/simakt/cluster.json configs/simakt/knn.json configs/simakt/dual.yaml

clean:  ## remove the test and lint caches (never ./artifacts: trained models are yours to delete)
	rm -rf .pytest_cache .ruff_cache
