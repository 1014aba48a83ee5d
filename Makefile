# Two entry points for a fresh machine (see README): `make demo` and `make test`.
# torch is installed first, pinned, so that pip never resolves an unpinned torch (on a
# machine without one that pulls several GB of CUDA packages). Override for other machines:
#   make demo SPECLM_TORCH_SPEC="torch==2.5.1 --index-url https://download.pytorch.org/whl/cu124"
PYTHON ?= python3
SPECLM_TORCH_SPEC ?= torch==2.13.0
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test browser clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(SPECLM_TORCH_SPEC)
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

# The main job: pull the default Qwen pair (once) and run speculative vs plain decoding.
demo: setup
	$(BIN)/speclm models pull qwen2.5-coder-1.5b
	$(BIN)/speclm models pull qwen2.5-coder-0.5b
	$(BIN)/speclm demo

# The whole suite, the real-model end-to-end test included. pytest exits 5 when it
# collects no test, which fails this target like any other failure.
test: setup browser
	$(BIN)/python -m pytest -q

# The server's page is tested in a real headless browser: Debian's chromium (playwright drives it;
# no browser download).
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null; }

clean:
	rm -rf $(VENV) build *.egg-info
