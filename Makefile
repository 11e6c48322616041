# The two commands of the quick start: `make demo` and `make test`.
# Everything lands in .venv; torch is pinned to the CPU build this project is tested with.
VENV ?= .venv
PYTHON ?= python3

$(VENV)/.installed: pyproject.toml $(wildcard switchagg/*.c switchagg/*.h)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q torch==2.13.0 -e '.[torch,p4,bench,dev,examples]'
	touch $@

.PHONY: install demo test lint fuzz asan
install: $(VENV)/.installed

demo: install
	$(VENV)/bin/switchagg demo

test: install
	VENV=$(VENV) bash scripts/test

lint: install
	$(VENV)/bin/ruff check .

# The fuzz suite (tests/test_fuzz.py) for FUZZ_SECONDS a surface (four surfaces), each printing its figures;
# a new seed each run unless FUZZ_SEED is given (the figures and any failure name it). A surface that stops
# answering dumps its stack after FUZZ_HANG seconds.
FUZZ_SECONDS ?= 60
FUZZ_SEED ?= $(shell date +%s)
FUZZ_HANG ?= 600
fuzz: install
	SWITCHAGG_FUZZ_SECONDS=$(FUZZ_SECONDS) SWITCHAGG_FUZZ_SEED=$(FUZZ_SEED) \
	  $(VENV)/bin/python -m pytest -q -s -p no:cacheprovider -o faulthandler_timeout=$(FUZZ_HANG) tests/test_fuzz.py

# The C extensions built with AddressSanitizer and UBSan into build/asan/, and the C-facing tests run on them.
asan: install
	VENV=$(VENV) bash scripts/asan
