# The two commands of the quick start: `make demo` and `make test`.
# Everything lands in .venv; torch is pinned to the CPU build this project is tested with.
VENV ?= .venv
PYTHON ?= python3

$(VENV)/.installed: pyproject.toml $(wildcard switchagg/*.c switchagg/*.h)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q torch==2.13.0 -e '.[torch,p4,bench,dev,examples]'
	touch $@

.PHONY: install demo test lint
install: $(VENV)/.installed

demo: install
	$(VENV)/bin/switchagg demo

test: install
	VENV=$(VENV) bash scripts/test

lint: install
	$(VENV)/bin/ruff check .
