# Spindle: every target installs what it needs first (see `install`).
# PYTHON may point at a virtual environment's interpreter: `make test PYTHON=.venv/bin/python`.
PYTHON ?= python3
SPINDLE := $(PYTHON) -m spindle_cli
STAMP := .make/installed
OUT ?= out

MODELS := multitask-clip ofasys qwen-val qwen-val-30b qwen-val-70b tiny-clip
SUBSETS := multitask-clip:4 multitask-clip:7 ofasys:4

.PHONY: install demo test check graphs profiles plans plans-check bench schemas clean

install: $(STAMP)

# torch is pinned to the CPU wheel that lies on this machine's disk (never a multi-GB CUDA build).
$(STAMP): pyproject.toml
	$(PYTHON) -m pip install --quiet "torch==2.13.0"
	$(PYTHON) -m pip install --quiet -e ".[runtime,test]"
	@mkdir -p $(dir $@) && touch $@

test: install
	$(PYTHON) -m pytest -q

clean:
	rm -rf $(OUT) .make .spindle-cache
