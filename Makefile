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
# nvdisasm shows the machine code (benchmarks/kernel_sass.py). Mosaic GPU runs it from ptxas'
# folder; it is taken out of its wheel, not installed: jax would then look for ptxas in that
# wheel's nvidia/cu13 (jax 0.10.2).
$(COMPILERS_STAMP): $(STAMP)
	v=$$($(BIN)/python -c 'import jax; print(jax.__version__)') && \
	$(BIN)/pip install "jax[tpu]==$$v" "jax-cuda12-plugin==$$v" nvidia-cuda-nvcc-cu12 absl-py
	rm -rf $(VENV)/nvdisasm && $(BIN)/pip download -q --no-deps -d $(VENV)/nvdisasm nvidia-cuda-nvdisasm==13.5.37 && \
	$(BIN)/python -c 'import glob, os, zipfile, nvidia.cuda_nvcc as m; \
	  out = os.path.join(m.__path__[0], "bin", "nvdisasm"); \
	  open(out, "wb").write(zipfile.ZipFile(glob.glob("$(VENV)/nvdisasm/*.whl")[0]).read("nvidia/cu13/bin/nvdisasm")); \
	  os.chmod(out, 0o755)'
	touch $(COMPILERS_STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/jaxserve serve

test: $(COMPILERS_STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -q --durations=25 tests

clean:
	rm -rf $(VENV) build *.egg-info
