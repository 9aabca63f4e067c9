# GPU Memory Lab. `make lab` to learn, `make test` to check everything (see README.md).
PY      ?= python3
VENV    ?= .venv
PYTHON  ?= $(VENV)/bin/python
# The lock: every package's version as verified by `make test` (see `make lock`); pip reads it as constraints.
LOCK    := labkit/lock.txt
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml $(LOCK) | cksum | cut -d' ' -f1)
TORCH   := torch==2.13.0
TESTENV := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 LABKIT_SIZE=tiny MPLBACKEND=Agg HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Two notebooks at a time, each file's tests (a notebook's cells: one kernel) in one worker.
WORKERS ?= 2
PYTEST  := -m pytest -n $(WORKERS) --dist loadfile -p no:cacheprovider
NBVAL   := --nbval-lax --nbval-cell-timeout=300
LOCKENV := build/lock-env
# How `make lab` starts JupyterLab (tests/browser reads these two lines): notebook 00 first; the project's
# settings overrides (no news toast) and config (nbgrader's instructor tools off), not the user's own.
LAB_ENV  := JUPYTER_CONFIG_PATH=$(CURDIR)/jupyter/config
LAB_ARGS := --ServerApp.root_dir=notebooks --LabApp.default_url=/lab/tree/00_start_here.ipynb --LabApp.app_settings_dir=$(CURDIR)/jupyter/settings
COURSE  := tests/course
BROWSER := tests/browser

.PHONY: env lab test test-unit test-notebooks test-gpu test-course test-browser workbook student instructor bench lock clean

# The environment: torch first (pinned, so nothing pulls another multi-GB build), then labkit and its
# extras, every package at the version the lock names.
$(STAMP): pyproject.toml $(LOCK)
	@test -x $(PYTHON) || $(PY) -c 'import sys; sys.exit(sys.version_info < (3, 11, 5))' || \
	  { echo "$(PY) is $$($(PY) -V 2>&1); the locked versions need Python 3.11.5 or newer."; \
	    echo "Run e.g. 'make $(or $(MAKECMDGOALS),env) PY=python3.12', or use environment.yml with conda."; exit 2; }
	@test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q -c $(LOCK) --upgrade pip
	$(PYTHON) -m pip install -q -c $(LOCK) $(TORCH)
	$(PYTHON) -m pip install -q -c $(LOCK) -e '.[all]'
	@rm -f $(VENV)/.installed-* && touch $@

env: $(STAMP)

lab: env
	@echo "Starting JupyterLab on notebooks/ (open the URL it prints; Ctrl-C to stop)."
	HF_HUB_OFFLINE=1 $(LAB_ENV) $(VENV)/bin/jupyter lab $(LAB_ARGS) $(if $(DISPLAY),,--no-browser) $(if $(filter 0,$(shell id -u)),--allow-root)

test: env
	$(TESTENV) $(PYTHON) $(PYTEST) tests notebooks $(NBVAL) --ignore=$(COURSE) --ignore=$(BROWSER)

test-unit: env
	$(TESTENV) $(PYTHON) $(PYTEST) tests --ignore=$(COURSE) --ignore=$(BROWSER)

test-notebooks: env
	$(TESTENV) $(PYTHON) $(PYTEST) notebooks $(NBVAL)

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

instructor: env
	$(PYTHON) -m labkit.cli instructor

# The course as a workshop uses it: every student notebook runs top to bottom with its checks "not attempted",
# and nbgrader's autograde gives the answer key full points (each notebook executed twice; one file, so its
# tests are spread over the workers one by one: --dist load).
test-course: env
	$(TESTENV) PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PYTHON) $(PYTEST) --dist load $(COURSE)

# JupyterLab driven in the system's Chromium (Debian: apt-get install -y chromium); Playwright's Python
# package only, never a browser of its own. Screenshots in build/browser/.
test-browser: env
	@test -x /usr/bin/chromium || command -v chromium >/dev/null || \
	  { echo "make test-browser drives the system Chromium: install it first (Debian/Ubuntu: sudo apt-get install -y chromium)."; exit 2; }
	$(PYTHON) -m pip install -q -c $(LOCK) -e '.[browser]'
	$(TESTENV) $(PYTHON) -m pytest -p no:cacheprovider -s $(BROWSER)

bench: env
	$(TESTENV) $(PYTHON) benchmarks/estimate_table.py
	$(TESTENV) $(PYTHON) benchmarks/track_overhead.py

# A new lock: pyproject.toml resolved afresh (newest allowed versions) in a clean venv, frozen with torch
# first and without local build labels (+cpu), then every test against it. Commit it only if this passes;
# on failure the old lock comes back and the new one stays in build/lock.failed.txt.
lock:
	rm -rf $(LOCKENV) && $(PY) -m venv $(LOCKENV)
	$(LOCKENV)/bin/python -m pip install -q --upgrade pip
	$(LOCKENV)/bin/python -m pip install -q $(TORCH)
	$(LOCKENV)/bin/python -m pip install -q -e '.[all]'
	$(LOCKENV)/bin/python -m pip freeze --all --exclude-editable | sed 's/+[^ ]*$$//' > build/freeze.txt
	cp $(LOCK) build/lock.old.txt
	{ echo "# Every package's version, as installed by \`make lock\` and verified by \`make test\` on"; \
	  $(LOCKENV)/bin/python -c "import platform, torch; print('#', platform.system(), platform.machine(), \
	    'CPython', platform.python_version(), 'with torch', torch.__version__)"; \
	  echo "# pip constraints (-c) for make and environment.yml; \`labkit doctor\` compares with it. Do not edit."; \
	  grep '^torch==' build/freeze.txt; grep -v '^torch==' build/freeze.txt; } > $(LOCK)
	$(TESTENV) $(LOCKENV)/bin/python $(PYTEST) tests notebooks $(NBVAL) \
	  || { cp $(LOCK) build/lock.failed.txt; cp build/lock.old.txt $(LOCK); exit 1; }
	@echo "$(LOCK) rewritten and verified: review \`git diff $(LOCK)\`, commit it, then \`make env\` installs it."

clean:
	rm -rf build .pytest_cache
