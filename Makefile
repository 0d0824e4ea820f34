# Spindle: every user-facing target installs what it needs first (see `install`; the artifact
# targets need only the planner: `core`).
# PYTHON may point at a virtual environment's interpreter: `make test PYTHON=.venv/bin/python`.
PYTHON ?= python3
SPINDLE := $(PYTHON) -m spindle_cli
# one install stamp per interpreter, so switching PYTHON installs into the new one (a PYTHON
# with spaces, `uv run python`, is one name too)
space := $(subst ,, )
STAMP := .make/installed-$(subst $(space),_,$(subst /,_,$(strip $(PYTHON))))
# the planner alone (no torch, no test tools): what the artifact targets need, so a CI job that
# only runs plans-check installs no torch
CORE_STAMP := $(subst installed-,planner-,$(STAMP))
# the demo's files (`make demo OUT=dir`; not taken from the environment, where OUT may name
# anything, since `make clean` removes it)
OUT := out
# OUT must be one word: make splits a path with spaces, and `make clean OUT="my out"` would
# remove my
out_spaces = OUT '$(OUT)' has spaces: make would read it as $(words $(OUT)) paths
# nor the root directory (/, /., /tmp/.. ...), where $(OUT)/demo is /demo
out_ok = $(if $(strip $(OUT)),$(if $(word 2,$(OUT)),$(error $(out_spaces)),$(if $(filter /,$(abspath \
	$(OUT))),$(error OUT '$(OUT)' is the root directory: make $(1) would $(2)))),$(error OUT is \
	empty: make $(1) would $(2)))
# --check on every generator target (graphs, profiles, plans, schemas): `make plans
# CHECK=--check` never writes; measure and bench, which cannot check, refuse it.
CHECK :=
no_check = $(if $(CHECK),$(error make $(1) has no --check: $(2)))
# refused as the Makefile is read, before a prerequisite (install) runs
ifneq ($(filter demo,$(MAKECMDGOALS)),)
$(call out_ok,demo,write to /demo)
endif
ifneq ($(filter clean,$(MAKECMDGOALS)),)
$(call out_ok,clean,remove /demo)
endif
ifneq ($(filter bench,$(MAKECMDGOALS)),)
$(call no_check,bench,its planning times differ from run to run (make plans-check checks the \
	committed artifacts))
endif
ifneq ($(filter measure,$(MAKECMDGOALS)),)
$(call no_check,measure,a measurement cannot be reproduced (make plans-check validates the \
	measured profile))
endif

# Analytic profiles per model: the cluster whose links the profile uses and its counts.
A800_64 := --hardware a800 --cluster clusters/a800-8x8.yaml --validate
A800_256 := --hardware a800 --cluster clusters/a800-32x8.yaml --validate \
	--counts 1,2,4,8,16,32,64,128,256

.PHONY: help install core demo test test-oldest check graphs profiles measure plans plans-check \
	bench schemas clean

# `make` alone lists the targets (it installed torch, the first target's work)
help:
	@echo "make demo         plan multitask-clip on a800-2x8, bench against the baselines, train tiny-clip on 4 CPU ranks (OUT=dir)"
	@echo "make test         plans-check, then the whole test suite"
	@echo "make test-oldest  the tests without torch on the oldest Python and releases pyproject.toml allows (OLDEST_PYTHON=python3.10)"
	@echo "make check        ruff, the schemas and plans-check"
	@echo "make plans        regenerate every committed graph, profile and plan (CHECK=--check: only check)"
	@echo "make plans-check  check that every committed artifact is what the code makes now"
	@echo "make measure      measure tiny-clip's profile on this machine, and its plans"
	@echo "make bench        regenerate docs/bench and run the benchmarks/ scripts (not the CP-SAT bench_wave_search.py)"
	@echo "make schemas      regenerate schemas/ (CHECK=--check: only check)"
	@echo "make install      install torch and spindle with its test tools (PYTHON=interpreter)"
	@echo "make clean        remove the demo's files, the install stamps and the measurement cache (.spindle-cache)"

install: $(STAMP)
core: $(CORE_STAMP)

# torch is pinned to the version whose CPU wheel lies on this project's machines' disk; the pin
# does not choose a CPU build by itself (see README: plain PyPI serves Linux the CUDA one).
$(STAMP): pyproject.toml
	$(PYTHON) -m pip install --quiet "torch==2.13.0"
	$(PYTHON) -m pip install --quiet -e ".[runtime,test]"
	@mkdir -p $(dir $@) && touch $@

$(CORE_STAMP): pyproject.toml
	$(if $(wildcard $(STAMP)),,$(PYTHON) -m pip install --quiet -e .)
	@mkdir -p $(dir $@) && touch $@

# The committed artifacts must be what the code makes now; then the whole suite.
test: install
	$(MAKE) --no-print-directory plans-check
	$(PYTHON) -m pytest -q

# What pyproject.toml promises: its oldest Python and the oldest release of every dependency
# (each ">=" floor pinned "=="), in a virtual environment of its own, made anew. Without torch
# (tests/runtime and the tests marked torch): its CPU build is not on PyPI.
OLDEST_PYTHON ?= python3.10
OLDEST_VENV := .make/oldest
test-oldest:
	rm -rf $(OLDEST_VENV)
	$(OLDEST_PYTHON) -m venv $(OLDEST_VENV)
	sed -n 's/^ *"\([A-Za-z0-9_.-]*\)>=\([0-9.]*\)",*$$/\1==\2/p' pyproject.toml \
		> $(OLDEST_VENV)/floors.txt
	$(OLDEST_VENV)/bin/python -m pip install --quiet -c $(OLDEST_VENV)/floors.txt -e ".[test]"
	$(OLDEST_VENV)/bin/python -m pytest -q --ignore=tests/runtime

check: install
	$(PYTHON) -m ruff check spindle_cli tests benchmarks
	$(PYTHON) -m spindle_cli.artifacts.schema --check schemas/
	$(MAKE) plans-check

# The main job: plan the shipped models on the default cluster, compare with the baselines,
# then train tiny-clip on 4 local CPU ranks with its Spindle plan.
demo: install
	@mkdir -p $(OUT)/demo
	$(SPINDLE) graph models/multitask-clip.yaml --task-set 4 -o $(OUT)/demo/multitask-clip-4.graph.yaml
	$(SPINDLE) profile $(OUT)/demo/multitask-clip-4.graph.yaml $(A800_64) -o $(OUT)/demo/multitask-clip-4.profile.yaml
	$(SPINDLE) plan $(OUT)/demo/multitask-clip-4.graph.yaml $(OUT)/demo/multitask-clip-4.profile.yaml \
		--cluster clusters/a800-2x8.yaml -o $(OUT)/demo/multitask-clip-4.plan.yaml
	$(SPINDLE) show $(OUT)/demo/multitask-clip-4.plan.yaml --text-gantt
	$(SPINDLE) simulate $(OUT)/demo/multitask-clip-4.plan.yaml
	$(SPINDLE) bench --quick --out $(OUT)/demo/bench
	$(SPINDLE) run plans/tiny-clip-local-cpu.yaml --nproc-per-node 4 --steps 5

# --- committed artifacts: regenerate (make plans: its graphs and profiles first) or verify
# (make plans-check). One target per file, after the targets of the files it reads, so that
# `make -j` never reads a file while it is rewritten, a model change reaches every plan made
# from it, and plans-check (make -k) names every stale file, not only the first.

# graph/NAME writes graphs/NAME.yaml from these `spindle graph` arguments
GRAPHS := multitask-clip ofasys qwen-val qwen-val-30b qwen-val-70b multitask-clip-4 \
	multitask-clip-7 ofasys-4 tiny-clip
graph_multitask-clip := models/multitask-clip.yaml
graph_ofasys := models/ofasys.yaml
graph_qwen-val := models/qwen-val.yaml
graph_qwen-val-30b := models/qwen-val-30b.yaml
graph_qwen-val-70b := models/qwen-val-70b.yaml
graph_multitask-clip-4 := models/multitask-clip.yaml --task-set 4
graph_multitask-clip-7 := models/multitask-clip.yaml --task-set 7
graph_ofasys-4 := models/ofasys.yaml --task-set 4
# tiny-clip is what `spindle run` trains on CPU ranks, in fp32: its bytes are counted in fp32
graph_tiny-clip := models/tiny-clip.yaml --dtype fp32

# profile/NAME writes profiles/NAME.yaml: GRAPH, then `spindle profile` options
PROFILES := multitask-clip-a800-8x8 ofasys-a800-8x8 qwen-val-a800-8x8 qwen-val-30b-a800-32x8 \
	qwen-val-70b-a800-32x8
profile_multitask-clip-a800-8x8 := multitask-clip $(A800_64)
profile_ofasys-a800-8x8 := ofasys $(A800_64)
profile_qwen-val-a800-8x8 := qwen-val $(A800_64)
profile_qwen-val-30b-a800-32x8 := qwen-val-30b $(A800_256)
profile_qwen-val-70b-a800-32x8 := qwen-val-70b $(A800_256)

# plan/NAME writes plans/NAME.yaml: GRAPH PROFILE CLUSTER, then `spindle plan` options.
# The tiny-clip plans are what `spindle run` trains on CPU ranks: the executor runs ZeRO-1/2
# and recomputation but keeps every layer's full weights (no ZeRO-3), and `--memory auto` would
# pick ZeRO-3 whenever it simulates faster, so these are planned without memory strategies.
RUNNABLE := --memory none --recompute off
PLANS := multitask-clip-4-a800-2x8 multitask-clip-7-a800-2x8 multitask-clip-a800-2x8 \
	ofasys-4-a800-2x8 ofasys-a800-2x8 qwen-val-a800-4x8 qwen-val-a800-8x8 \
	qwen-val-30b-a800-32x8 qwen-val-70b-a800-32x8 tiny-clip-local-cpu tiny-clip-local-cpu-2
plan_multitask-clip-4-a800-2x8 := multitask-clip-4 multitask-clip-a800-8x8 a800-2x8
plan_multitask-clip-7-a800-2x8 := multitask-clip-7 multitask-clip-a800-8x8 a800-2x8
plan_multitask-clip-a800-2x8 := multitask-clip multitask-clip-a800-8x8 a800-2x8
plan_ofasys-4-a800-2x8 := ofasys-4 ofasys-a800-8x8 a800-2x8
plan_ofasys-a800-2x8 := ofasys ofasys-a800-8x8 a800-2x8
plan_qwen-val-a800-4x8 := qwen-val qwen-val-a800-8x8 a800-4x8
plan_qwen-val-a800-8x8 := qwen-val qwen-val-a800-8x8 a800-8x8
plan_qwen-val-30b-a800-32x8 := qwen-val-30b qwen-val-30b-a800-32x8 a800-32x8
plan_qwen-val-70b-a800-32x8 := qwen-val-70b qwen-val-70b-a800-32x8 a800-32x8
plan_tiny-clip-local-cpu := tiny-clip tiny-clip-local-cpu local-cpu $(RUNNABLE)
plan_tiny-clip-local-cpu-2 := tiny-clip tiny-clip-local-cpu local-cpu-2 $(RUNNABLE)

.SECONDEXPANSION:
# A target's prerequisites: the targets of the files it reads, except under CHECK, which
# writes nothing: there every check runs on its own, so `make -k` names every stale file.
after = $(if $(CHECK),,$(1))
.PHONY: $(GRAPHS:%=graph/%) $(PROFILES:%=profile/%) profile/tiny-clip-local-cpu $(PLANS:%=plan/%)

# `make plans` regenerates every graph, profile and plan (each plan's own first), and so its
# CHECK checks them all; `make profiles CHECK=--check` the graphs too
graphs: $(GRAPHS:%=graph/%)
profiles: $(PROFILES:%=profile/%) profile/tiny-clip-local-cpu $(if $(CHECK),graphs)
plans: $(PLANS:%=plan/%) $(if $(CHECK),graphs profiles)

$(GRAPHS:%=graph/%): graph/%: core
	$(SPINDLE) graph $(graph_$*) $(CHECK) -o graphs/$*.yaml

$(PROFILES:%=profile/%): profile/%: core $$(call after,graph/$$(firstword $$(profile_$$*)))
	$(SPINDLE) profile graphs/$(firstword $(profile_$*)).yaml $(wordlist 2,99,$(profile_$*)) \
		$(CHECK) -o profiles/$*.yaml

# The measured tiny-clip profile is made once on purpose, never here: a measurement cannot be
# reproduced byte for byte. Here it is only checked against its graph; remake it with
# `make measure` when that changed.
profile/tiny-clip-local-cpu: core $(call after,graph/tiny-clip)
	@$(SPINDLE) validate profiles/tiny-clip-local-cpu.yaml || { echo "profiles/tiny-clip-local-cpu.yaml \
	is measured, not regenerated: once the error above is mended, 'make measure' remakes it if \
	it is stale" >&2; exit 1; }

measure: install graph/tiny-clip
	$(SPINDLE) profile graphs/tiny-clip.yaml --hardware local --cluster clusters/local-cpu.yaml \
		--validate --repeats 20 --no-cache -o profiles/tiny-clip-local-cpu.yaml
	$(MAKE) --no-print-directory plan/tiny-clip-local-cpu plan/tiny-clip-local-cpu-2

$(PLANS:%=plan/%): plan/%: core \
		$$(call after,graph/$$(word 1,$$(plan_$$*)) profile/$$(word 2,$$(plan_$$*)))
	$(SPINDLE) plan graphs/$(word 1,$(plan_$*)).yaml profiles/$(word 2,$(plan_$*)).yaml \
		--cluster clusters/$(word 3,$(plan_$*)).yaml $(wordlist 4,99,$(plan_$*)) $(CHECK) \
		-o plans/$*.yaml

# Verify that every committed graph, profile and plan is what the code makes now (-k: all of
# them, however many are stale).
plans-check:
	@$(MAKE) --no-print-directory -k graphs profiles plans CHECK=--check || { echo "hint: 'make plans' \
	regenerates the stale ones ('make measure' the measured tiny-clip profile); an invalid \
	input named above needs mending first" >&2; exit 1; }

bench: install
	$(SPINDLE) bench --out docs/bench
	$(SPINDLE) bench --dynamic --out docs/bench
	$(PYTHON) benchmarks/bench_profile.py
	$(PYTHON) benchmarks/bench_planner.py
	$(PYTHON) benchmarks/bench_sweep.py
	$(PYTHON) benchmarks/bench_simulator.py
	$(PYTHON) benchmarks/bench_runtime.py

schemas: core
	$(PYTHON) -m spindle_cli.artifacts.schema $(CHECK) schemas/

clean:
	rm -rf $(OUT)/demo .make .spindle-cache
	@rmdir $(OUT) 2>/dev/null || true
