# Two commands on a fresh machine:   make demo   |   make test
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# (lock, image: see below)
.PHONY: lock image demo test test-fast test-under-load bytecode lint fmt bench gpu-check venv clean docs system-deps

# Prometheus, promtool, Alertmanager and amtool from Debian's packages (the tests start them).
system-deps:
	bash scripts/system-deps.sh

$(STAMP): pyproject.toml requirements-dev.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -r requirements-dev.txt
	touch $(STAMP)

venv: $(STAMP)

# deploy/container/requirements.lock: the sidecar image's dependencies (pyproject.toml's, with the
# `stacks` extra) and build backend, each pinned with its hashes; the Dockerfile installs from it
# with --require-hashes. Run it after changing the dependencies (tests/ops/test_image.py says when
# the lock is stale); it needs PyPI.
LOCK := deploy/container/requirements.lock
lock: $(STAMP)
	CUSTOM_COMPILE_COMMAND="make lock" $(BIN)/pip-compile --quiet --generate-hashes --allow-unsafe \
		--build-deps-for wheel --extra stacks --strip-extras --no-emit-index-url --no-emit-find-links \
		--output-file $(LOCK) pyproject.toml

# The images deploy/kubernetes names, built and pushed to your registry (needs Docker and a login
# to REGISTRY): `make image REGISTRY=registry.example/ml [TAG=0.1.0]`. It ends with the line that
# sets them in the kustomization you apply (MAKE-IMAGE-REGISTRY there is a placeholder).
TAG ?= 0.1.0
image:
	@test -n "$(REGISTRY)" || { echo "make image REGISTRY=<registry/path>: where to push the images" >&2; exit 2; }
	docker build -f deploy/container/Dockerfile --target sidecar -t $(REGISTRY)/training-sidecar:$(TAG) .
	docker build -f deploy/container/Dockerfile --target node-problem-detector -t $(REGISTRY)/training-sidecar-npd:$(TAG) .
	docker push $(REGISTRY)/training-sidecar:$(TAG)
	docker push $(REGISTRY)/training-sidecar-npd:$(TAG)
	@echo "In the kustomization you apply (deploy/kubernetes or an overlay), run:"
	@echo "  kustomize edit set image MAKE-IMAGE-REGISTRY/training-sidecar=$(REGISTRY)/training-sidecar:$(TAG) \\"
	@echo "    MAKE-IMAGE-REGISTRY/training-sidecar-npd=$(REGISTRY)/training-sidecar-npd:$(TAG)"

demo: $(STAMP)
	$(BIN)/python -m demo

# Style, format, types and the rooms' import contracts (all configured in pyproject.toml);
# `make test` runs it first.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/python scripts/module_size.py

# Format the tree and apply ruff's safe fixes (import order, pyupgrade).
fmt: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Five workers on two cores: much of the suite's time is waiting (step floors, restarts, rule
# `for:` windows), so more workers than cores fill it (on 2 cores five keep the CPUs about 90% busy).
# `TEST_WORKERS=N` to change it.
TEST_WORKERS ?= 5

# The tests start hundreds of Python processes (sidecars, CLI calls, ranks) that import the
# project; without its bytecode each compiles it again (0.3 CPU-s to import the sidecar with it,
# 1.1 without): a fresh clone has none, and none is written where PYTHONDONTWRITEBYTECODE is set.
# pip compiles what it installs; this does the same for the checkout.
BYTECODE_DIRS := sidecar trainer_hooks sidecar_trainer alerts dashboards bench demo harness scripts tests

bytecode: $(STAMP)
	$(BIN)/python -m compileall -q -j 0 $(BYTECODE_DIRS)

# pytest keeps the test modules it rewrote for its asserts only where bytecode may be written
# (each worker rewrites all of them otherwise, 4-5 CPU-s each): allowed for the test run.
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest

test: lint system-deps bytecode
	$(PYTEST) -n $(TEST_WORKERS) --dist loadgroup

# The inner loop: nothing of ten seconds or more (`slow`: torchrun jobs, training runs, load
# tests), nothing that needs the Debian packages (`system`), no lint. About 3 minutes on 2
# cores; `make test` before you push.
test-fast: $(STAMP) bytecode
	$(PYTEST) -n $(TEST_WORKERS) --dist loadgroup -m "not slow and not system"

# The whole suite beside a CPU hog that keeps about 2 runnable tasks per core (scripts/cpu_hog.py:
# busy loops added and stopped as the suite's own load moves; its summary line says what load the
# run had, `LOAD=N` to change it). CI machines are seldom idle: what fails here fails at random there.
LOAD ?= 2
test-under-load: lint system-deps bytecode
	$(BIN)/python scripts/cpu_hog.py --load $(LOAD) --log .cpu_hog.log -- \
		env PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup

bench: $(STAMP)
	$(BIN)/python -m bench

# On a GPU node: the GPU collector against the real NVML (skips cleanly without a driver).
gpu-check: $(STAMP) system-deps
	$(BIN)/python -m bench.gpu_check

docs: $(STAMP)
	$(BIN)/sidecar metrics-doc --write docs/metrics.md
	$(BIN)/sidecar config-doc --write docs/configuration.md
	$(BIN)/python -m alerts.build
	$(BIN)/python -m dashboards.build
	$(BIN)/sidecar deploy-gen --write

clean:
	rm -rf $(VENV) build *.egg-info
