PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/jaxserve serve

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -q tests

clean:
	rm -rf $(VENV) build *.egg-info
