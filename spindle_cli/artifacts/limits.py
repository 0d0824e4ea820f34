"""Bounds on artifact values that are well typed but no real model, cluster or plan reaches.

Without them a value like `num_nodes: 10**30` or a link of 0.5 B/s passes validation and then
hangs or overflows the planner, the simulator or the runtime. Each bound sits orders of
magnitude beyond what the shipped files and the planner benchmarks use (the paper's clusters
have 256 GPUs, the benchmarks 4096 devices, the largest modules about 100 layers), so it only
ever rejects a typo or a corrupted file. Every bound comes with the reason the error prints.
"""

from __future__ import annotations

MAX_DEVICES = 2**20
"""Most devices in a cluster or a plan, and the highest device count a profile may hold."""

MAX_DEVICES_WHY = "about a million; the largest training clusters have ~10**5 devices"

MAX_LAYERS = 100_000
"""Most layers in a module; layer indices and slice bounds stay at or below it."""

MAX_LAYERS_WHY = "the deepest real models have a few hundred layers per module"

MAX_WIDTH = 2**20
"""Widest layer dimension a model may declare (hidden, ffn, in_dim, heads)."""

MAX_WIDTH_WHY = "about a million; the widest real layers are ~10**5"

MAX_TOKENS = 2**24
"""Largest vocabulary and longest sequence a model may declare."""

MAX_TOKENS_WHY = "about 16 million; real vocabularies and contexts are ~10**6 at most"

MAX_BATCH = 2**30
"""Largest global batch of a task (samples per iteration)."""

MAX_BATCH_WHY = "about a billion samples; real global batches are below ~10**7"

MIN_BANDWIDTH_BYTES_PER_S = 1e6
"""Slowest link a cluster may declare (1 MB/s)."""

MIN_BANDWIDTH_WHY = "1 MB/s; every real interconnect is at least 1000x faster"

MIN_MEMORY_BANDWIDTH_WHY = "1 MB/s; a device's own memory is over 10**4x faster"

MAX_BANDWIDTH_BYTES_PER_S = 1e16
"""Fastest link or device memory a cluster may declare (10 PB/s). The simulator's flows move
bytes at link rates shared between flows: at 1e308 B/s a rate overflowed to inf, a flow's
bytes moved became NaN, and `spindle plan` never ended."""

MAX_BANDWIDTH_WHY = "10 PB/s; the fastest links and device memories move ~10**12-10**13 B/s"

MIN_PEAK_FLOPS = 1e6
"""Slowest device a cluster may declare (1 MFLOP/s). `spindle simulate` divides a MetaOp's
FLOPs by it for MFU; at 1e-300 that overflowed to inf, which `--json` printed as the
non-JSON `Infinity`."""

MIN_PEAK_FLOPS_WHY = "1 MFLOP/s; one CPU core does over 10**9"

MAX_PEAK_FLOPS = 1e18
"""Fastest device a cluster may declare (1 EFLOP/s): the analytic profile divides FLOPs by it,
and operator times far below a femtosecond are refused (MIN_OPERATOR_MS)."""

MAX_PEAK_FLOPS_WHY = "1 EFLOP/s per device; the fastest accelerators do ~10**15"

MAX_LINK_LATENCY_S = 1.0
"""Highest per-message latency a cluster may declare."""

MAX_LINK_LATENCY_WHY = "real links take microseconds per message"

MIN_OPERATOR_MS = 1e-12
"""Shortest time a scaling curve may give one operator (a femtosecond). The planner divides by
these times, so zero, negative and underflowing ones must go; a fitted curve whose last piece
falls towards 0 as n grows (alpha 0) stays far above it at any count its batch can use."""

MAX_MS = 1e12
"""Longest time an artifact may record (ms): about 30 years. Times come from curves and sum
into iterations; a finite but huge one (1e307) overflows to inf or NaN on the way."""

MAX_MS_WHY = "about 30 years; an iteration takes seconds"

MAX_FILE_BYTES = 2**30
"""Largest artifact file read (1 GiB; a plan of 100,000 waves is about 63 MB)."""

MAX_NESTING = 1000
"""Deepest nesting of lists and mappings an artifact file may have (artifacts nest about 6
levels deep). libyaml's composer recurses on the C stack and would crash the process on
nesting in the tens of thousands, so deeper files are refused before they are parsed."""

MAX_EXPANDED_NODES = 10**6
"""Most values (mappings, lists, scalars) an artifact file may hold once its YAML aliases are
expanded (the largest shipped artifact holds about 19000). PyYAML builds an aliased value once
and shares it, but validating, hashing and writing the data visit every reference, so a few
nested aliases (a "billion laughs" file of a few hundred bytes) would take hours."""
