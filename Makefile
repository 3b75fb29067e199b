# One command sets up and runs the main job, one sets up and runs the tests.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo parity test fuzz lint docs setup clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[test,docs]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m functorch_optim demo

parity: $(STAMP)
	$(BIN)/python -m functorch_optim parity

# the unit tests, the notebooks (executed), the documentation site (strict)
test: $(STAMP)
	$(BIN)/python -m pytest -q
	PYTHONPATH=$(CURDIR) $(BIN)/python -m pytest -q -p no:cacheprovider --nbmake examples
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --quiet

# property-based fuzzing against torch with ten times the suite's examples (and shrinking)
fuzz: $(STAMP)
	FUNCTORCH_OPTIM_FUZZ=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_fuzz.py

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

lint: $(STAMP)
	$(BIN)/ruff check functorch_optim tests
	$(BIN)/ruff format --check functorch_optim tests

clean:
	rm -rf $(VENV) .pytest_cache site
