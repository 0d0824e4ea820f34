# Spindle: every user-facing target installs what it needs first (see `install`).
# PYTHON may point at a virtual environment's interpreter: `make test PYTHON=.venv/bin/python`.
PYTHON ?= python3
SPINDLE := $(PYTHON) -m spindle_cli
# one install stamp per interpreter, so switching PYTHON installs into the new one
STAMP := .make/installed-$(subst /,_,$(PYTHON))
OUT ?= out
# --check on every generator target: `make plans CHECK=--check` never writes.
CHECK ?=

# Analytic profiles per model: the cluster whose links the profile uses and its counts.
A800_64 := --hardware a800 --cluster clusters/a800-8x8.yaml --validate
A800_256 := --hardware a800 --cluster clusters/a800-32x8.yaml --validate \
	--counts 1,2,4,8,16,32,64,128,256

.PHONY: install demo test check graphs profiles measure plans plans-check bench schemas clean

install: $(STAMP)

# torch is pinned to the CPU wheel that lies on this machine's disk (never a multi-GB CUDA build).
$(STAMP): pyproject.toml
	$(PYTHON) -m pip install --quiet "torch==2.13.0"
	$(PYTHON) -m pip install --quiet -e ".[runtime,test]"
	@mkdir -p $(dir $@) && touch $@

# The committed artifacts must be what the code makes now; then the whole suite.
test: install
	$(MAKE) --no-print-directory plans-check
	$(PYTHON) -m pytest -q

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

# --- committed artifacts: regenerate (make graphs profiles plans) or verify (make plans-check)
GRAPH_MODELS := multitask-clip ofasys qwen-val qwen-val-30b qwen-val-70b

graphs: install
	for m in $(GRAPH_MODELS); do $(SPINDLE) graph models/$$m.yaml $(CHECK) -o graphs/$$m.yaml || exit 1; done
	$(SPINDLE) graph models/multitask-clip.yaml --task-set 4 $(CHECK) -o graphs/multitask-clip-4.yaml
	$(SPINDLE) graph models/multitask-clip.yaml --task-set 7 $(CHECK) -o graphs/multitask-clip-7.yaml
	$(SPINDLE) graph models/ofasys.yaml --task-set 4 $(CHECK) -o graphs/ofasys-4.yaml
# tiny-clip is what `spindle run` trains on CPU ranks, in fp32: its bytes are counted in fp32
	$(SPINDLE) graph models/tiny-clip.yaml --dtype fp32 $(CHECK) -o graphs/tiny-clip.yaml

# The measured tiny-clip profile (profiles/tiny-clip-local-cpu.yaml) is made once on purpose,
# never here: a measurement cannot be reproduced byte for byte. Remake it with `make measure`.
profiles: install
	for m in multitask-clip ofasys qwen-val; do \
		$(SPINDLE) profile graphs/$$m.yaml $(A800_64) $(CHECK) -o profiles/$$m-a800-8x8.yaml || exit 1; done
	for m in qwen-val-30b qwen-val-70b; do \
		$(SPINDLE) profile graphs/$$m.yaml $(A800_256) $(CHECK) -o profiles/$$m-a800-32x8.yaml || exit 1; done

measure: install
	$(SPINDLE) profile graphs/tiny-clip.yaml --hardware local --cluster clusters/local-cpu.yaml \
		--validate --repeats 20 --no-cache -o profiles/tiny-clip-local-cpu.yaml

# plan NAME GRAPH PROFILE CLUSTER [OPTIONS]
define plan_one
	$(SPINDLE) plan graphs/$(2).yaml profiles/$(3).yaml --cluster clusters/$(4).yaml $(5) $(CHECK) -o plans/$(1).yaml
endef
# The tiny-clip plans are what `spindle run` trains on CPU ranks: the executor runs ZeRO-1/2
# and recomputation but keeps every layer's full weights (no ZeRO-3), and `--memory auto` would
# pick ZeRO-3 whenever it simulates faster, so these are planned without memory strategies.
RUNNABLE := --memory none --recompute off

plans: install
	$(call plan_one,multitask-clip-4-a800-2x8,multitask-clip-4,multitask-clip-a800-8x8,a800-2x8)
	$(call plan_one,multitask-clip-7-a800-2x8,multitask-clip-7,multitask-clip-a800-8x8,a800-2x8)
	$(call plan_one,multitask-clip-a800-2x8,multitask-clip,multitask-clip-a800-8x8,a800-2x8)
	$(call plan_one,ofasys-4-a800-2x8,ofasys-4,ofasys-a800-8x8,a800-2x8)
	$(call plan_one,ofasys-a800-2x8,ofasys,ofasys-a800-8x8,a800-2x8)
	$(call plan_one,qwen-val-a800-4x8,qwen-val,qwen-val-a800-8x8,a800-4x8)
	$(call plan_one,qwen-val-a800-8x8,qwen-val,qwen-val-a800-8x8,a800-8x8)
	$(call plan_one,qwen-val-30b-a800-32x8,qwen-val-30b,qwen-val-30b-a800-32x8,a800-32x8)
	$(call plan_one,qwen-val-70b-a800-32x8,qwen-val-70b,qwen-val-70b-a800-32x8,a800-32x8)
	$(call plan_one,tiny-clip-local-cpu,tiny-clip,tiny-clip-local-cpu,local-cpu,$(RUNNABLE))
	$(call plan_one,tiny-clip-local-cpu-2,tiny-clip,tiny-clip-local-cpu,local-cpu-2,$(RUNNABLE))

# Verify that every committed graph, analytic profile and plan is what the code makes now.
plans-check:
	$(MAKE) --no-print-directory graphs profiles plans CHECK=--check

bench: install
	$(SPINDLE) bench --out docs/bench
	$(SPINDLE) bench --dynamic --out docs/bench
	$(PYTHON) benchmarks/bench_profile.py
	$(PYTHON) benchmarks/bench_planner.py
	$(PYTHON) benchmarks/bench_simulator.py
	$(PYTHON) benchmarks/bench_runtime.py

schemas: install
	$(PYTHON) -m spindle_cli.artifacts.schema schemas/

clean:
	rm -rf $(OUT) .make .spindle-cache
