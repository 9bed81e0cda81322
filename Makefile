# `make test` and `make up` are the two commands; both create .venv and install .[dev] once.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: test up install bench clean compose-test

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

# The compose stack built, started and driven for real (tests/compose_stack.py); needs root.
compose-test: $(STAMP)
	$(VENV)/bin/python tests/compose_stack.py

up: $(STAMP)
	$(VENV)/bin/deepinfer up $(UP_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
