# GPU Memory Lab. `make lab` to learn, `make test` to check everything (see README.md).
PY      ?= python3
VENV    ?= .venv
PYTHON  ?= $(VENV)/bin/python
# The lock: every package's version for every platform, as verified by `make test` (see `make lock`); pip
# reads it as constraints, and its environment markers pick the lines for this machine.
LOCK    := labkit/lock.txt
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml $(LOCK) | cksum | cut -d' ' -f1)
TORCH   := torch==2.13.0
# Where torch comes from: the registry (PyPI) by default, whose Linux torch is a CUDA 13 build (about 6 GB
# in .venv with its CUDA libraries). A Linux laptop without a GPU can take the CPU-only build instead, on a
# fresh .venv:
#   make lab TORCH_INDEX=https://download.pytorch.org/whl/cpu
# torch alone comes from that index and from nowhere else (--no-deps): where it cannot be reached, make
# stops and says so, rather than fall back to the registry's CUDA build. Its dependencies come from PyPI.
TORCH_INDEX ?=
define TORCH_FROM_INDEX
	@echo "torch from $(TORCH_INDEX) only (TORCH_INDEX), its dependencies from the registry"
	@$(1) -m pip install -q --retries 2 --no-deps --index-url $(TORCH_INDEX) -c $(2) $(TORCH) || \
	  { echo "make: torch could not be installed from TORCH_INDEX=$(TORCH_INDEX) (unreachable, or no $(TORCH) there)."; \
	    echo "Nothing else was installed. Check the address and the network, or leave TORCH_INDEX out to take the"; \
	    echo "registry's torch (on Linux a CUDA build: about 6 GB)."; exit 2; }
endef
TESTENV := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 LABKIT_SIZE=tiny MPLBACKEND=Agg HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Two notebooks at a time, each file's tests (a notebook's cells: one kernel) in one worker.
WORKERS ?= 2
PYTEST  := -m pytest -n $(WORKERS) --dist loadfile -p no:cacheprovider
NBVAL   := --nbval-lax --nbval-cell-timeout=300
LOCKENV := build/lock-env
# `make lab` opens the student build (build/student: solutions stubbed, checks "not attempted"), brought in
# step with notebooks/ on every start; `make lab KEY=1` opens the answer key, notebooks/ itself.
KEY     ?=
LAB_DIR  = $(if $(KEY),notebooks,build/student)
# How `make lab` starts JupyterLab (tests/browser reads these two lines): notebook 00 first; the project's
# settings overrides (no news toast) and config (nbgrader's instructor tools off), not the user's own.
LAB_ENV  := JUPYTER_CONFIG_PATH=$(CURDIR)/jupyter/config
LAB_ARGS := --ServerApp.root_dir=$(LAB_DIR) --LabApp.default_url=/lab/tree/00_start_here.ipynb --LabApp.app_settings_dir=$(CURDIR)/jupyter/settings
# The GPU targets run with any Python that has torch (PYTHON=python3 on a machine with a CUDA torch): labkit
# comes from this folder through PYTHONPATH, nothing is installed, and nbval's kernels (started in
# notebooks/) inherit it.
GPUENV   = PYTHONPATH=$(if $(WHEELS),$(GPU_SITE):)$(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH)) MPLBACKEND=Agg HF_HUB_OFFLINE=1
# The system's Chromium (Debian: /usr/bin/chromium) unless named: make test-browser CHROMIUM=/usr/bin/google-chrome
CHROMIUM ?= $(firstword $(wildcard /usr/bin/chromium) $(shell command -v chromium 2>/dev/null))
COURSE  := tests/course
BROWSER := tests/browser

.PHONY: env lab test test-unit test-notebooks test-gpu gpu-smoke gpu-wheels check-gpu-wheels twin-env test-twin check-resolution test-course test-browser workbook student instructor bench lock clean

# The environment: torch first (pinned, so nothing pulls another multi-GB build), then labkit and its
# extras, every package at the version the lock names.
$(STAMP): pyproject.toml $(LOCK)
	@test -x $(PYTHON) || $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "$(PY) is $$($(PY) -V 2>&1); the locked versions need Python 3.11 or newer (3.11-3.13 are checked)."; \
	    echo "Run e.g. 'make $(or $(MAKECMDGOALS),env) PY=python3.12', or use environment.yml with conda."; exit 2; }
	@test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(if $(TORCH_INDEX),$(call TORCH_FROM_INDEX,$(PYTHON),$(LOCK)))
	$(PYTHON) -m pip install -q -c $(LOCK) --upgrade pip
	$(PYTHON) -m pip install -q -c $(LOCK) $(TORCH)
	$(PYTHON) -m pip install -q -c $(LOCK) -e '.[all]'
	@rm -f $(VENV)/.installed-* && touch $@

env: $(STAMP)

lab: env
	@if [ -n "$(KEY)" ]; then echo "The answer key: notebooks/ (every solution written out; plain make lab opens the exercises)."; \
	  else $(PYTHON) -m labkit.cli student --in-step; fi
	@echo "Starting JupyterLab on $(LAB_DIR)/ (open the URL it prints; Ctrl-C to stop)."
	HF_HUB_OFFLINE=1 $(LAB_ENV) $(PYTHON) -m jupyter lab $(LAB_ARGS) $(if $(DISPLAY),,--no-browser) $(if $(filter 0,$(shell id -u)),--allow-root)

test: env
	$(TESTENV) $(PYTHON) $(PYTEST) tests notebooks $(NBVAL) --ignore=$(COURSE) --ignore=$(BROWSER)

test-unit: env
	$(TESTENV) $(PYTHON) $(PYTEST) tests --ignore=$(COURSE) --ignore=$(BROWSER)

test-notebooks: env
	$(TESTENV) $(PYTHON) $(PYTEST) notebooks $(NBVAL)

# On a CUDA machine: every notebook at full size, plus the GPU-only checks in tests/test_gpu.py, within
# 10 minutes on one H100-class GPU: parallel workers on the one GPU, each notebook's kernel fenced to a 24 GB
# card's memory, each result (status, minutes, peak) in data/gpu/<gpu>.jsonl (labkit/scripts/gpu_run.py).
# With .venv (make env) or a Python that already has a CUDA torch: make test-gpu PYTHON=python3.
# NOTEBOOKS="03 05": only those (NOTEBOOKS=todo: what this GPU has not passed yet); GPU_WORKERS=N;
# WHEELS=build/gpu-wheels: first install that folder (make gpu-wheels) offline into build/gpu-site.
# GPU_ARGS: the script's own options (--budget SECONDS, --fence 22GiB, --plan).
GPU_WORKERS ?=
GPU_ARGS ?=
WHEELS ?=
GPU_SITE := $(CURDIR)/build/gpu-site
INSTALL_WHEELS = $(if $(WHEELS),$(PYTHON) -m pip install -q --no-index --no-deps --no-compile --upgrade --target $(GPU_SITE) $(WHEELS)/*.whl &&)
test-gpu:
	@started=$$(date +%s); \
	command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) does not exist: run 'make env' first, or name a Python that has a CUDA torch: make test-gpu PYTHON=python3"; exit 2; }; \
	$(INSTALL_WHEELS) $(GPUENV) $(PYTHON) labkit/scripts/check_python.py test-gpu && \
	$(GPUENV) $(PYTHON) -m labkit.scripts.gpu_run --started $$started $(if $(NOTEBOOKS),--notebooks $(NOTEBOOKS)) \
	  $(if $(GPU_WORKERS),--workers $(GPU_WORKERS)) $(GPU_ARGS)

# For a GPU machine without a network: the wheels `make test-gpu` needs beyond the GPU image
# (data/gpu/image.txt), for CPython 3.12 on Linux x86-64, into build/gpu-wheels/ (with the repository's
# tree, under 64 MiB); needs the package registry (labkit/scripts/gpu_wheels.py).
gpu-wheels: env
	$(PYTHON) labkit/scripts/gpu_wheels.py --dest build/gpu-wheels

# The folder installed offline (--no-index) into a clean Python 3.12 venv beside the image's packages (taken
# from the twin), and a notebook run there under nbval as `make test-gpu` runs one (tests/test_gpu_wheels.py).
check-gpu-wheels: gpu-wheels twin-env
	$(TESTENV) LABKIT_TWIN=$(abspath $(TWIN)) $(PYTHON) -m pytest -p no:cacheprovider -q tests/test_gpu_wheels.py

# The twin: the GPU image's versions on this CPU (Python 3.12, the registry's torch 2.11 CUDA build, triton
# 3.6, transformers 5.17: data/gpu/image.txt), built from the registry alone into TWIN (kept while its
# inputs are unchanged; about 6 GB), then every notebook at tiny size and the unit tests in it, labkit from
# this folder (labkit/scripts/twin.py). TWIN_PY: its Python 3.12 (default: python3.12, else pyenv's).
TWIN    ?= build/twin
TWIN_PY ?=
# What the twin leaves to `make test`: tests of files and configuration, the same on any version.
TWIN_SKIP ?= $(addprefix --ignore=tests/,test_hygiene.py test_seeds.py test_ci.py test_twin.py test_resolution.py \
             test_lock.py test_gpu_wheels.py)
twin-env:
	$(PY) labkit/scripts/twin.py env --venv $(TWIN) $(if $(TWIN_PY),--python $(TWIN_PY))

# tests/twin/: triton 3.6's CPU interpreter given triton 3.7's one-line fix for numpy 2.4+ (its sitecustomize).
test-twin: twin-env
	$(TESTENV) PYTHONPATH=$(CURDIR)/tests/twin:$(CURDIR) $(TWIN)/bin/python $(PYTEST) tests notebooks $(NBVAL) \
	  --nbval-current-env --ignore=$(COURSE) --ignore=$(BROWSER) $(TWIN_SKIP)

# At most 5 minutes on one CUDA GPU, counted from the command's start (--started): the most valuable GPU
# checks first, each result a JSON line in data/gpu/<gpu>.jsonl (labkit/scripts/gpu_smoke.py; without CUDA
# it says so and exits 2, as does make). SMOKE_ARGS: the script's own options, e.g. SMOKE_ARGS="--only flash,tf32".
SMOKE_ARGS ?=
gpu-smoke:
	@started=$$(date +%s); \
	command -v $(PYTHON) >/dev/null || { echo "$(PYTHON) does not exist: run 'make env' first, or name a Python that has a CUDA torch: make gpu-smoke PYTHON=python3"; exit 2; }; \
	$(INSTALL_WHEELS) $(GPUENV) $(PYTHON) labkit/scripts/check_python.py gpu-smoke && \
	echo "$(GPUENV) $(PYTHON) -m labkit.scripts.gpu_smoke --started $$started $(SMOKE_ARGS)" && \
	$(GPUENV) $(PYTHON) -m labkit.scripts.gpu_smoke --started $$started $(SMOKE_ARGS)

# Needs the package registry: the lock resolves, wheels only, on macOS arm64, Windows x86-64, Linux aarch64
# and x86-64 for Python 3.11-3.13, and installs here as `make env` does from the registry alone.
check-resolution: env
	LABKIT_RESOLVE=1 $(PYTHON) -m pytest -p no:cacheprovider -q tests/test_resolution.py

# Each cell may run 300 s at tiny size, 900 s at full (labkit workbook --cell-timeout): a notebook that hangs
# fails, and the next one runs.
# make workbook NOTEBOOKS="05 10": only those (the page keeps the others' last results).
NOTEBOOKS ?=
workbook: env
	HF_HUB_OFFLINE=1 $(PYTHON) -m labkit.cli workbook $(if $(NOTEBOOKS),--notebooks $(NOTEBOOKS))

student: env
	$(PYTHON) -m labkit.cli student

instructor: env
	$(PYTHON) -m labkit.cli instructor

# The course as a workshop uses it: every student notebook runs top to bottom with its checks "not attempted",
# and nbgrader's autograde gives the answer key full points (each notebook executed twice; one file, so its
# tests are spread over the workers one by one: --dist load).
test-course: env
	$(TESTENV) PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PYTHON) $(PYTEST) --dist load $(COURSE)

# JupyterLab driven in the system's Chromium (Debian: apt-get install -y chromium) or a Chrome named with
# CHROMIUM=...; Playwright's Python package only, never a browser of its own. Screenshots in build/browser/.
test-browser: env
	@test -n "$(CHROMIUM)" && test -x "$(CHROMIUM)" || \
	  { echo "make test-browser drives the system's Chromium or Chrome: install it (Debian: sudo apt-get install -y chromium)"; \
	    echo "or name it: make test-browser CHROMIUM=/usr/bin/google-chrome (Ubuntu's chromium is a snap: use Chrome)."; exit 2; }
	$(PYTHON) -m pip install -q -c $(LOCK) -e '.[browser]'
	CHROMIUM=$(CHROMIUM) $(TESTENV) $(PYTHON) -m pytest -p no:cacheprovider -s $(BROWSER)

bench: env
	$(TESTENV) $(PYTHON) benchmarks/estimate_table.py
	$(TESTENV) $(PYTHON) benchmarks/track_overhead.py

# A new lock: pyproject.toml resolved for every platform and Python 3.11-3.13 at once (uv pip compile
# --universal, environment markers where they differ), keeping each version the old lock names where it
# still fits (UPGRADE=1: the newest allowed), torch first; then the resolution checks (wheels only, every
# platform; needs the registry) and every test in a clean venv against it. It is kept only if all pass; on
# failure the old lock comes back and the new one stays in build/lock.failed.txt.
UV_COMPILE = pip compile pyproject.toml - --all-extras --universal --python-version 3.11 --no-config \
             --no-header --no-annotate $(if $(UPGRADE),--upgrade)
lock:
	rm -rf $(LOCKENV) && $(PY) -m venv $(LOCKENV) && mkdir -p build
	$(LOCKENV)/bin/python -m pip install -q -c $(LOCK) uv
	cp $(LOCK) build/lock.old.txt && cp $(LOCK) build/lock.resolved.txt
	echo pip | $(LOCKENV)/bin/python -m uv $(UV_COMPILE) -o build/lock.resolved.txt
	$(if $(TORCH_INDEX),$(call TORCH_FROM_INDEX,$(LOCKENV)/bin/python,build/lock.resolved.txt))
	$(LOCKENV)/bin/python -m pip install -q --upgrade pip
	$(LOCKENV)/bin/python -m pip install -q -c build/lock.resolved.txt $(TORCH)
	{ echo "# Every package's version, for every platform and Python 3.11-3.13 (a universal lock, environment markers"; \
	  echo "# on the lines that differ), resolved by \`make lock\` (uv pip compile --universal) from pyproject.toml and"; \
	  $(LOCKENV)/bin/python -c "import platform, torch; print('# verified by \`make test\` on', platform.system(), \
	    platform.machine(), 'CPython', platform.python_version(), 'with torch', torch.__version__ + ';', '.ci/run checks that it')"; \
	  echo "# resolves, wheels only, on macOS arm64, Windows x86-64, Linux aarch64 and x86-64 (labkit/scripts/check_resolution.py)."; \
	  echo "# pip constraints (-c) for make and environment.yml; \`labkit doctor\` compares with the lines for its machine. Do not edit."; \
	  grep '^torch==' build/lock.resolved.txt; grep -v '^torch==' build/lock.resolved.txt; } > $(LOCK)
	$(LOCKENV)/bin/python -m pip install -q -c $(LOCK) -e '.[all]'
	{ $(LOCKENV)/bin/python -m labkit.scripts.check_resolution && \
	  $(TESTENV) $(LOCKENV)/bin/python $(PYTEST) tests notebooks $(NBVAL) --ignore=$(COURSE) --ignore=$(BROWSER); } \
	  || { cp $(LOCK) build/lock.failed.txt; cp build/lock.old.txt $(LOCK); exit 1; }
	@echo "$(LOCK) rewritten and verified: review \`git diff $(LOCK)\`, commit it, then \`make env\` installs it."

clean:
	rm -rf build .pytest_cache
