# gpushare developer entry points. Each target installs what it needs into .venv on first use.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
# The exact versions the suite passed with: pip itself, the package's dependencies (-c) and its build
# requirements in pip's isolated build environment (--build-constraint: pip >= 26 no longer applies -c or
# PIP_CONSTRAINT there, so an unpinned build once took the day's newest grpcio-tools).
CONSTRAINTS := $(CURDIR)/constraints.txt
PIP_INSTALL = $(PY) -m pip install -q --disable-pip-version-check -c $(CONSTRAINTS)
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)

.PHONY: install run test test-fast lint bench soak clean constraints

install: $(STAMP)

# The package (editable: its build writes the kubelet gRPC modules into the checkout), the local stack's and the
# tests' helpers (extras `dev`, `test`), all at the versions of constraints.txt.
$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing gpushare and its dependencies into $(VENV) (constraints.txt) ..."
	@$(PIP_INSTALL) pip
	@$(PIP_INSTALL) --build-constraint $(CONSTRAINTS) -e '.[dev,test]'
	@$(PY) -m shared.kubelet_api --check
	@rm -f $(VENV)/.installed-*
	@touch $@

# kubelet's gRPC modules follow their .proto files: a pulled change to one is compiled before the next run, test
# or bench, not only when the dependencies change (the bench once ran a node agent calling a method its stale
# modules did not have).
PROTO_OUT := $(patsubst %.proto,%_pb2.py,$(wildcard shared/kubelet_api/*.proto))
$(PROTO_OUT): %_pb2.py: %.proto | $(STAMP)
	@$(PY) -m shared.kubelet_api

# After upgrading packages in .venv and a green `make test`: pin what is installed now.
constraints:
	@{ sed -n '1,4p' constraints.txt; $(PY) -m pip freeze --all --exclude-editable | grep -v -i '^#' \
	  | LC_ALL=C sort -f; } > constraints.txt.new && mv constraints.txt.new constraints.txt

# The main job: the whole stack locally (control plane, Postgres, NATS, the four services, a demo).
run: $(STAMP) $(PROTO_OUT)
	$(PY) -m services.cli up $(ARGS)

# Lint (ruff's checks, then its formatting: both fail the target), then the whole test suite against real
# PostgreSQL and NATS (embedded ones unless GPUSHARE_TEST_DATABASE_URL / GPUSHARE_TEST_NATS_URL name servers).
# The test files run in TEST_WORKERS parallel workers (pytest-xdist), each file whole in one worker, so a module's
# control plane and servers are started once; most of the suite waits on servers, so 3 workers fit 2 cores.
TEST_WORKERS ?= 3
test: lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# Lint, formatting and types ([tool.mypy] in pyproject.toml): each fails the target.
lint: $(STAMP) $(PROTO_OUT)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

bench: $(STAMP) $(PROTO_OUT)
	$(PY) -m bench $(ARGS)

soak: $(STAMP) $(PROTO_OUT)
	GPUSHARE_SOAK=1 $(PY) -m pytest tests/reliability tests/security -q -rxX --durations=15 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .gpushare build *.egg-info
