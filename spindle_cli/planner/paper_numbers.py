"""The paper's evaluation numbers, to print beside ours (never to tune against).

Source: Wang et al., "Spindle: Efficient Distributed Training of Multi-Task Large Models via
Wavefront Scheduling", ASPLOS 2025 (https://doi.org/10.1145/3676641.3715992), as collected in
../shared/paper/algorithms-and-numbers.md §9 (Fig. 8 reconstructed from the figure's bar
labels, §9.3; Fig. 10 labels, §9.2; Fig. 11 and 12, §9.1) and the 256-GPU simulated appendix
result quoted in ../shared/paper/spindle-explainer.txt.

Speedups are over DeepSpeed (= 1.00), which our `sequential` baseline stands for (tasks one
after another on the whole cluster, the paper's temporal decoupling of Megatron-LM/DeepSpeed).
"""

from __future__ import annotations

PLANNER_COLUMNS = {"spindle": "S", "optimus": "O", "distmm": "D", "megatron": "M"}
"""Our planner names -> the paper's Fig. 8 columns (S Spindle, O Spindle-Optimus, D DistMM-MT,
M Megatron-LM)."""

FIG8_SPEEDUP: dict[tuple[str, int, int], dict[str, float]] = {
    ("multitask-clip", 4, 8): {"S": 1.21, "O": 0.96, "D": 1.09, "M": 1.02},
    ("multitask-clip", 4, 16): {"S": 1.22, "O": 1.00, "D": 1.08, "M": 1.05},
    ("multitask-clip", 4, 32): {"S": 1.52, "O": 1.36, "D": 1.20, "M": 1.09},
    ("multitask-clip", 7, 8): {"S": 1.31, "O": 0.73, "D": 1.09, "M": 1.02},
    ("multitask-clip", 7, 16): {"S": 1.26, "O": 0.84, "D": 1.09, "M": 1.04},
    ("multitask-clip", 7, 32): {"S": 1.54, "O": 1.15, "D": 1.17, "M": 1.01},
    ("multitask-clip", 10, 8): {"S": 1.37, "O": 0.50, "D": 1.08, "M": 1.01},
    ("multitask-clip", 10, 16): {"S": 1.33, "O": 0.93, "D": 1.08, "M": 1.02},
    ("multitask-clip", 10, 32): {"S": 1.71, "O": 1.38, "D": 1.14, "M": 1.05},
    ("ofasys", 4, 8): {"S": 1.53, "O": 1.23, "D": 1.01, "M": 0.99},
    ("ofasys", 4, 16): {"S": 1.42, "O": 1.20, "D": 1.01, "M": 0.98},
    ("ofasys", 4, 32): {"S": 1.51, "O": 1.28, "D": 1.04, "M": 1.01},
    ("ofasys", 7, 8): {"S": 1.71, "O": 1.17, "D": 1.07, "M": 1.02},
    ("ofasys", 7, 16): {"S": 1.43, "O": 1.12, "D": 1.03, "M": 0.98},
    ("ofasys", 7, 32): {"S": 1.33, "O": 1.13, "D": 1.06, "M": 1.01},
    ("qwen-val", 3, 32): {"S": 1.16, "O": 1.04, "D": 1.04, "M": 1.02},
    ("qwen-val", 3, 64): {"S": 1.63, "O": 1.44, "D": 1.11, "M": 1.03},
    # Appendix E (simulated by the authors): only Spindle's value and "at most 1.09x" for the
    # other baselines are quoted.
    ("qwen-val-30b", 3, 256): {"S": 1.34},
    ("qwen-val-70b", 3, 256): {"S": 1.36},
}
"""(model, tasks, GPUs) -> speedup over DeepSpeed per Fig. 8 column (§9.3)."""

FIG10_TRANSFER_SHARE: dict[tuple[str, int, int], tuple[float, float]] = {
    ("multitask-clip", 10, 8): (0.032, 0.097),
    ("multitask-clip", 10, 16): (0.057, 0.27),
    ("ofasys", 7, 8): (0.038, 0.103),
    ("ofasys", 7, 16): (0.062, 0.206),
    ("qwen-val", 3, 32): (0.017, 0.061),
    ("qwen-val", 3, 64): (0.025, 0.087),
}
"""(model, tasks, GPUs) -> share of the iteration in inter-wave send/recv with Spindle's
placement and with sequential placement (§9.2)."""

FIG11_MAX_GAP = 1.07
"""Iteration time over the relaxed optimum C*: at most 1.07 on Multitask-CLIP with 4/7/10
tasks on 16 and 32 GPUs (bar labels 1.02-1.07; which bar is which is uncertain, §9.1)."""

FIG12_MAX_PLAN_SECONDS = 3.0
"""Planning time: under 3 s for every experiment, 8-64 GPUs (§9.1)."""


def speedup(model: str, num_tasks: int, num_devices: int, planner: str) -> float | None:
    """The paper's speedup over DeepSpeed for one of our planners (sequential = 1.00), or None
    where the paper gives no number."""
    row = FIG8_SPEEDUP.get((model, num_tasks, num_devices))
    if row is None:
        return None
    if planner == "sequential":
        return 1.0
    return row.get(PLANNER_COLUMNS.get(planner, ""))


def transfer_share(model: str, num_tasks: int, num_devices: int,
                   placement: str) -> float | None:
    """The paper's inter-wave transfer share for Spindle with 'island' (its own) or
    'sequential' placement, or None where the paper gives no number."""
    pair = FIG10_TRANSFER_SHARE.get((model, num_tasks, num_devices))
    if pair is None:
        return None
    return pair[0] if placement == "island" else pair[1]
