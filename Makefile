PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
COMPILERS_STAMP := $(VENV)/.compilers

.PHONY: install serve test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install -e ".[test]"
	touch $(STAMP)

# The real accelerator compilers, for the compile checks (tests/test_tpu_compile.py,
# tests/test_gpu_compile.py, `jaxserve check`), at the versions the installed jax asks for:
# libtpu, and the CUDA plugin with ptxas (no CUDA driver or runtime libraries: compile only).
$(COMPILERS_STAMP): $(STAMP)
	v=$$($(BIN)/python -c 'import jax; print(jax.__version__)') && \
	$(BIN)/pip install "jax[tpu]==$$v" "jax-cuda12-plugin==$$v" nvidia-cuda-nvcc-cu12 absl-py
	touch $(COMPILERS_STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/jaxserve serve

test: $(COMPILERS_STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -q --durations=25 tests

clean:
	rm -rf $(VENV) build *.egg-info
