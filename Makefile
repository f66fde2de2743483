# A convenience wrapper around CMake for the few commands a newcomer needs.
# Everything it does is plain cmake/ctest; see README.md.
BUILD ?= build
ASAN_BUILD ?= build-asan
FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 600
FUZZ_SEED ?= 1
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
CMAKE_FLAGS ?=

.PHONY: all build run single test pyenv sanitize fuzz clean

all: build

$(BUILD)/CMakeCache.txt:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j$(JOBS)

# The main job: one MoE layer step on 4 ranks, checked (last line OK/FAILED).
run: build
	$(BUILD)/tools/epx-bench

# The one-rank microbenchmark against memcpy and the dense one-hot einsums.
single: build
	$(BUILD)/tools/epx-bench --single

# The Python the binding's tests run with: a venv over Debian's python3 (its
# numpy, pytest and mpi4py) holding torch (the package index's Linux wheel,
# which runs on CPUs) and scikit-build-core (the wheel's build backend), made
# once by `make pyenv`. PYTHON=/usr/bin/python3 runs the tests without torch
# (the epx.torch tests then skip). megatron-core and deepspeed (CPU, no
# compiled ops) are the drop-ins' references, and with nemo-automodel (its
# DeepEP module and MoE layer) epx.deep_ep's framework parity tests;
# megatron-core imports numpy.dtypes, which needs a numpy newer than Debian 12's
# 1.24.
PYENV ?= $(BUILD)/pyenv
PYTHON ?= $(PYENV)/bin/python
SYSTEM_PYTHON ?= /usr/bin/python3

$(PYENV)/.ready:
	$(SYSTEM_PYTHON) -m venv --system-site-packages $(PYENV)
	$(PYENV)/bin/python -m pip install -q --disable-pip-version-check "torch>=2.5" "scikit-build-core>=0.8"
	$(PYENV)/bin/python -m pip install -q --disable-pip-version-check "numpy>=1.25,<2" "megatron-core==0.16.1"
	DS_BUILD_OPS=0 $(PYENV)/bin/python -m pip install -q --disable-pip-version-check "deepspeed==0.19.8"
	# NeMo Automodel's MoE layer imports transformers (NeMo 0.7.0's pin, with
	# its dependencies: ~30 MB of wheels, ~15 s); NeMo's other dependencies
	# (CUDA kernels, torchao, ...) are not installed: its DeepEP module and MoE
	# layer need torch and transformers only.
	$(PYENV)/bin/python -m pip install -q --disable-pip-version-check "transformers==5.18.0" "numpy>=1.25,<2"
	$(PYENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps "nemo-automodel==0.7.0"
	touch $@

pyenv: $(PYENV)/.ready

# ctest (C tests, MPI tests, the example, small bench runs), then the Python
# binding's tests (tests/python: numpy, torch, MPI processes, the wheel).
test: build $(if $(filter $(PYENV)/bin/python,$(PYTHON)),pyenv)
	cd $(BUILD) && ctest --output-on-failure
	EPX_LIBRARY=$(BUILD)/libepx.so PYTHONPATH=python $(PYTHON) -m pytest -q tests/python

# AddressSanitizer + UBSan build in its own directory, and its tests. OpenMPI's
# allocations outlive MPI_Finalize, so leak checks are off for the MPI tests.
sanitize:
	cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEPX_SANITIZE=ON $(CMAKE_FLAGS)
	cmake --build $(ASAN_BUILD) -j$(JOBS)
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 ctest --output-on-failure -LE gpu -E mpi
	cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=0:halt_on_error=1 ctest --output-on-failure -LE gpu -R mpi

# The fuzzers (clang, ASan + UBSan; tests/fuzz), FUZZ_SECONDS each: libFuzzer
# on the one-rank API (its corpus kept in $(FUZZ_BUILD)/corpus, a finding's
# input in $(FUZZ_BUILD)/crash-*), then the seeded multi-rank scenarios from
# FUZZ_SEED, ranks in different collective calls among them (a finding
# prints its seed; re-run it with --seed N --count 1).
fuzz:
	CC=clang cmake -S . -B $(FUZZ_BUILD) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEPX_BUILD_FUZZERS=ON \
	  -DEPX_BUILD_TESTS=OFF -DEPX_BUILD_MPI=OFF $(CMAKE_FLAGS)
	cmake --build $(FUZZ_BUILD) -j$(JOBS) --target fuzz_api fuzz_scenarios
	mkdir -p $(FUZZ_BUILD)/corpus
	$(FUZZ_BUILD)/tests/fuzz/fuzz_api -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 \
	  -artifact_prefix=$(FUZZ_BUILD)/ $(FUZZ_BUILD)/corpus
	$(FUZZ_BUILD)/tests/fuzz/fuzz_scenarios --seconds $(FUZZ_SECONDS) --seed $(FUZZ_SEED) --mismatched

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(FUZZ_BUILD)
