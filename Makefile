# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel on machines that carry it. On a GPU box PyPI's Linux torch is a CUDA build; for another
# CUDA, name PyTorch's index: make install TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
TARGET ?= cpu-tiny-sdxl

.PHONY: install test test-fast lint demo clean device-wheels wheel

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)")
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

test: install
	$(PY) -m pytest -q -ra --durations=15

test-fast: install
	$(PY) -m pytest -q -ra -m "not slow"

lint: install
	$(VENV)/bin/ruff check aotbuild tests

demo: install
	$(VENV)/bin/aotbuild build --target $(TARGET)
	$(VENV)/bin/aotbuild run --target $(TARGET) --prompt "a red fox in the snow" --steps 4 --seed 0 --output demo.png

# The package as a wheel for serving images and fleets: its runtime needs (torch, diffusers,
# transformers, safetensors, huggingface_hub, click, pillow, numpy), no test or build extras.
wheel: install
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w dist .
	@ls dist/aotbuild-*.whl

# What the GPU device machine lacks (it has torch, transformers, huggingface_hub, pytest; see the
# device tool's KINDS.md), as wheels for scripts/gpu_check.sh: carry .whl there.
device-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: -d .whl -c constraints.txt diffusers importlib_metadata

clean:
	rm -rf artifacts/*/ artifacts/.staging demo*.png dist build
