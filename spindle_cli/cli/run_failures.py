"""Why a `spindle run` failed, in one line: from torchrun's record of each failed rank (its
exit code or signal, its time, and the error file a rank writes, `worker._report_failure`),
the rank error that caused the others, the hint that rank wrote beside it, and what an
aborted rank most likely means on nccl.
"""

from __future__ import annotations

import re
import signal
from typing import Any

INTERRUPTED = 128 + signal.SIGINT
"""The exit code of a rank that took a SIGINT (`worker.main`)."""

KILLED_BY_LAUNCHER_S = 10
"""A rank SIGKILLed this long after a peer lost contact with it was killed by the launcher,
not from outside: torch's launcher sends SIGTERM and kills a rank still there 30 s later (a
hung or stopped rank), and it sees a rank killed from outside within its 0.1 s poll."""


def root_cause(e: object) -> str:
    """One line for a failed run: the earliest rank error that is not just a lost peer; else
    the earliest rank that died without a line and not by the launcher's SIGTERM (killed from
    outside, say by the OOM killer, or exited on its own) unless it was a rank its peers had
    lost that the launcher killed when it did not stop (hung, or stopped by SIGSTOP); else
    the earliest lost-peer line (it names the suspects), plus the ranks it lost that SIGTERM
    ended from outside (their peers saw them close, not time out) and the ranks the launcher
    stopped."""
    failures = getattr(e, "failures", {})
    if not failures:
        return "a worker failed"

    def line(rank: int) -> str:
        message = failures[rank].message
        return message if isinstance(message, str) and message.startswith("rank ") else ""

    def secondary(rank: int) -> bool:
        data = failures[rank].error_file_data
        return bool(isinstance(data, dict) and data.get("spindle", {}).get("secondary"))

    def peers(rank: int) -> list[int]:
        """The peers the line of `rank`, a lost peer's, says it lost contact with."""
        return list(failures[rank].error_file_data["spindle"].get("peers", ()))

    def lost_by(rank: int) -> list[int]:
        """The ranks whose lines say they lost contact with `rank`, earliest first."""
        return sorted((r for r in failures if line(r) and secondary(r) and rank in peers(r)),
                      key=when)

    def killed_hung(rank: int) -> bool:
        lost = lost_by(rank)
        return (failures[rank].exitcode == -signal.SIGKILL and bool(lost)
                and failures[rank].timestamp - failures[lost[0]].timestamp
                >= KILLED_BY_LAUNCHER_S)

    def stopped_by_launcher(rank: int) -> bool:
        return failures[rank].exitcode == -signal.SIGTERM or killed_hung(rank)

    def died(rank: int) -> str:
        f = failures[rank]
        if f.exitcode < 0:
            return f"rank {rank} was killed by signal {-f.exitcode} ({f.signal_name()})"
        if f.exitcode == INTERRUPTED:
            # a rank interrupted alone: a Ctrl-C reaches the launcher too, which says it once
            return f"rank {rank} was interrupted (SIGINT) from outside the run"
        return f"rank {rank} exited with code {f.exitcode}"

    def when(rank: int) -> tuple[int, int]:
        return failures[rank].timestamp, rank

    reported = sorted((r for r in failures if line(r)), key=lambda r: (secondary(r), *when(r)))
    if reported and not secondary(reported[0]):
        return line(reported[0])
    silent = [r for r in failures if not line(r)]
    own = sorted((r for r in silent if not stopped_by_launcher(r)), key=when)
    if own:
        return died(own[0])
    if reported:
        text = line(reported[0])
        hung = sorted(r for r in silent if killed_hung(r))
        if hung:
            who = (f"rank {hung[0]}", "it") if len(hung) == 1 else (
                f"ranks {', '.join(map(str, hung))}", "them")
            text += (f"; {who[0]} then did not stop when asked and the launcher killed {who[1]} "
                     "(SIGKILL): hung, or stopped (SIGSTOP)")
        others = [r for r in sorted(silent) if r not in hung]
        # a rank the lines lost that SIGTERM ended: a hung rank the launcher stopped once a
        # peer timed out waiting for it, or, where its peers saw its connection close
        # instead, a kill from outside (torch's timestamps, whole seconds, cannot tell)
        lost = [r for r in others if lost_by(r) and not any(
            re.search(r"time[ d]*out", line(p), re.IGNORECASE) for p in lost_by(r))]
        # a line lost in a collective names every peer of it, the launcher's SIGTERMs among
        # them; a line that names one peer alone (a transfer) says which it lost
        named = sorted({peers(p)[0] for p in reported
                        if secondary(p) and len(peers(p)) == 1 and peers(p)[0] in lost})
        if named or len(lost) == 1:
            lost = named or lost
            text += (f"; rank{'s' * (len(lost) > 1)} {', '.join(map(str, lost))} had ended by "
                     "SIGTERM from outside the run (its peers saw its connection close, not "
                     "time out)")
        elif lost:
            text += (f"; of ranks {', '.join(map(str, lost))}, one or more had ended by "
                     "SIGTERM from outside the run and the launcher stopped the others (their "
                     "peers saw a connection close in a collective of them all, not time out: "
                     "which, they cannot tell)")
        stopped = [r for r in others if r not in lost]
        if stopped:
            text += (f"; the launcher {'also ' if hung or lost else 'then '}stopped rank(s) "
                     f"{', '.join(map(str, stopped))}")
        return text
    return died(min(silent, key=when))


def record_of(e: object, cause: str) -> dict[str, Any]:
    """The `spindle` entry of the error file of the rank whose line `cause` reports
    (`worker._report_failure`); empty when no rank's line is the cause."""
    for f in getattr(e, "failures", {}).values():
        data = f.error_file_data
        if isinstance(f.message, str) and f.message and cause.startswith(f.message) \
                and isinstance(data, dict):
            record = data.get("spindle", {})
            return record if isinstance(record, dict) else {}
    return {}


def hint_of(e: object, cause: str) -> str | None:
    """The hint that the rank whose line `cause` reports wrote beside it (its error file)."""
    hint = record_of(e, cause).get("hint")
    return hint if isinstance(hint, str) else None


def abort_hint(cause: str, backend: str) -> str | None:
    """What an aborted rank (SIGABRT, no line of its own) most likely means on nccl: NCCL's
    watchdog tears a rank down when a collective or transfer does not complete within the
    timeout, where gloo raises an error the rank reports ('lost contact with rank(s)')."""
    if backend != "nccl" or "(SIGABRT)" not in cause:
        return None
    return ("on nccl, a collective or transfer that does not complete within --timeout-s makes "
            "NCCL's watchdog abort the rank: a peer crashed, hung or disagreed; "
            "TORCH_CPP_LOG_LEVEL=ERROR shows the watchdog's message")
