# GPU Memory Lab. `make lab` to learn, `make test` to check everything (see README.md).
PY      ?= python3
VENV    ?= .venv
PYTHON  ?= $(VENV)/bin/python
STAMP   := $(VENV)/.installed-$(shell cksum < pyproject.toml | cut -d' ' -f1)
TORCH   := torch==2.13.0
TESTENV := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 LABKIT_SIZE=tiny MPLBACKEND=Agg HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

.PHONY: env lab test test-unit test-notebooks test-gpu workbook student clean

# The environment: torch first (pinned, so nothing pulls another multi-GB build), then labkit and its extras.
$(STAMP): pyproject.toml
	@test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q $(TORCH)
	$(PYTHON) -m pip install -q -e '.[all]'
	@rm -f $(VENV)/.installed-* && touch $@

env: $(STAMP)

lab: env
	@echo "Starting JupyterLab on notebooks/ (open the URL it prints; Ctrl-C to stop)."
	HF_HUB_OFFLINE=1 $(VENV)/bin/jupyter lab notebooks/ $(if $(DISPLAY),,--no-browser) $(if $(filter 0,$(shell id -u)),--allow-root)

test: env
	$(TESTENV) $(PYTHON) -m pytest tests notebooks --nbval-lax --nbval-cell-timeout=300 -p no:cacheprovider

test-unit: env
	$(TESTENV) $(PYTHON) -m pytest tests -p no:cacheprovider

test-notebooks: env
	$(TESTENV) $(PYTHON) -m pytest notebooks --nbval-lax --nbval-cell-timeout=300 -p no:cacheprovider

# On a CUDA machine: every notebook at full size, plus the GPU-only checks in tests/test_gpu.py.
test-gpu:
	@$(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || \
	  { echo "make test-gpu needs a CUDA GPU, and torch sees none here. Use 'make test' for the tiny size on a CPU."; exit 2; }
	LABKIT_SIZE=full MPLBACKEND=Agg HF_HUB_OFFLINE=1 $(PYTHON) -m pytest tests/test_gpu.py notebooks \
	  --nbval-lax --nbval-cell-timeout=900 -p no:cacheprovider

workbook: env
	HF_HUB_OFFLINE=1 $(PYTHON) -m labkit.cli workbook

student: env
	$(PYTHON) -m labkit.cli student

clean:
	rm -rf build .pytest_cache
