"""The collective and P2P timeouts of a run, without torch: `spindle run` parses --timeout-s
with them before it imports any of the runtime."""

from __future__ import annotations

DEFAULT_TIMEOUT_S = 300.0
"""Collective and P2P timeout: a rank that stops answering fails its peers after this long."""
MAX_TIMEOUT_S = 604800.0
"""The longest timeout a run accepts: 7 days, below every limit of torch's. c10d's socket
helpers take poll() timeouts in milliseconds as a C int (2**31 - 1 ms is 24.8 days; no run
was seen to fail there), and larger values fail the run (torch 2.13, measured with `spindle
run`): from about 9.2e9 s the TCP store's deadline (int64 nanoseconds) overflows, so the
rendezvous hangs or times out at once; from 8.6e13 s gloo refuses the negative count; from
1e16 s timedelta raises OverflowError."""
