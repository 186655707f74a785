# gpushare developer entry points. Each target installs what it needs into .venv on first use.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: install run test test-fast lint bench soak clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing gpushare and its dependencies into $(VENV) ..."
	@$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	@$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	@$(PY) -m shared.kubelet_api
	@rm -f $(VENV)/.installed-*
	@touch $@

# The main job: the whole stack locally (control plane, Postgres, NATS, the four services, a demo).
run: $(STAMP)
	$(PY) -m services.cli up $(ARGS)

# Lint, then the whole test suite against real PostgreSQL and NATS (embedded ones unless
# GPUSHARE_TEST_DATABASE_URL / GPUSHARE_TEST_NATS_URL name servers).
test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check . || true

bench: $(STAMP)
	$(PY) -m bench $(ARGS)

soak: $(STAMP)
	GPUSHARE_SOAK=1 $(PY) -m pytest tests/reliability tests/security -q -rxX --durations=15 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .gpushare build *.egg-info
