# One command sets up and runs the main job, one sets up and runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo parity test fuzz lint docs setup clean

# pip prints a line per package it collects and installs (about 80 s the first time)
$(STAMP): pyproject.toml constraints.txt
	@echo "set-up 1/3: a virtual environment in $(VENV)"
	$(PY) -m venv $(VENV)
	@echo "set-up 2/3: pip"
	$(BIN)/pip install --progress-bar off --upgrade pip
	@echo "set-up 3/3: functorch_optim with its test and docs extras (torch, jax, mkdocs, ...), pinned by constraints.txt"
	$(BIN)/pip install --progress-bar off -c constraints.txt -e '.[test,docs]'
	touch $(STAMP)
	@echo "set-up done: $(VENV)"

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m functorch_optim demo

parity: $(STAMP)
	$(BIN)/python -m functorch_optim parity

# the unit tests (tests/test_site.py builds the documentation site strictly into site/ and
# opens it in headless Chromium), then the notebooks (executed)
test: $(STAMP)
	$(BIN)/python -m pytest -q
	PYTHONPATH=$(CURDIR) $(BIN)/python -m pytest -q -p no:cacheprovider --nbmake examples

# property-based fuzzing against torch with ten times the suite's examples (and shrinking)
fuzz: $(STAMP)
	FUNCTORCH_OPTIM_FUZZ=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_fuzz.py

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

# ruff over the whole tree: the package, tests, benchmarks, docs hooks, notebooks and
# the Python blocks of the Markdown files
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache site
