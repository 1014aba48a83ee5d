# Two entry points for a fresh machine (see README): `make demo` and `make test`.
# torch is installed first, pinned, so that pip never resolves an unpinned torch (on a
# machine without one that pulls several GB of CUDA packages). Override for other machines:
#   make demo SPECLM_TORCH_SPEC="torch==2.5.1 --index-url https://download.pytorch.org/whl/cu124"
PYTHON ?= python3
SPECLM_TORCH_SPEC ?= torch==2.13.0
VENV ?= .venv
BIN := $(VENV)/bin
# The tested versions of everything but torch (constraints.txt); empty to resolve the newest.
CONSTRAINTS ?= constraints.txt
PIN := $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
# The bench's peers (speclm.bench.peers): llama.cpp and OpenVINO GenAI in speclm's environment, and
# optimum-intel, which exports models for OpenVINO, in one of its own: it pins an older transformers.
# Its torchvision (a CUDA build) breaks beside a CPU torch and no export needs it, so it is removed.
EXPORT_VENV ?= .venv-openvino-export
OPTIMUM_SPEC ?= optimum-intel[openvino]==2.2.0
export SPECLM_OPTIMUM_CLI ?= $(abspath $(EXPORT_VENV))/bin/optimum-cli

.PHONY: setup peers demo test browser clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(SPECLM_TORCH_SPEC)
	$(BIN)/pip install --quiet $(PIN) -e '.[dev]'
	touch $@

peers: $(VENV)/.peers

$(VENV)/.peers: $(VENV)/.installed
	$(BIN)/pip install --quiet $(PIN) -e '.[peers]'
	$(PYTHON) -m venv $(EXPORT_VENV)
	$(EXPORT_VENV)/bin/pip install --quiet $(SPECLM_TORCH_SPEC)
	$(EXPORT_VENV)/bin/pip install --quiet '$(OPTIMUM_SPEC)' $(SPECLM_TORCH_SPEC)
	$(EXPORT_VENV)/bin/pip uninstall --quiet -y torchvision
	touch $@

# The main job: pull the default Qwen pair (once) and run speculative vs plain decoding.
demo: setup
	$(BIN)/speclm models pull qwen2.5-coder-1.5b
	$(BIN)/speclm models pull qwen2.5-coder-0.5b
	$(BIN)/speclm demo

# The whole suite, the real-model end-to-end test and the peers' included. pytest exits 5 when
# it collects no test, which fails this target like any other failure.
test: setup browser peers
	$(BIN)/python -m pytest -q

# The server's page is tested in a real headless browser: Debian's chromium (playwright drives it;
# no browser download).
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null; }

clean:
	rm -rf $(VENV) $(EXPORT_VENV) build *.egg-info
