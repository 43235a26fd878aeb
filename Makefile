PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LIBTPU_STAMP := $(VENV)/.libtpu

.PHONY: install serve test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e ".[test]"
	touch $(STAMP)

# libtpu for the TPU compile check (tests/test_tpu_compile.py, `jaxserve check`): the version
# the installed jax asks for, whichever jax that is.
$(LIBTPU_STAMP): $(STAMP)
	$(BIN)/pip install "jax[tpu]==$$($(BIN)/python -c 'import jax; print(jax.__version__)')"
	touch $(LIBTPU_STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/jaxserve serve

test: $(LIBTPU_STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -q tests

clean:
	rm -rf $(VENV) build *.egg-info
