"""Each rank's process: `python -m spindle_cli.runtime.rank PLAN [options]`, what `spindle run`
starts through torch's elastic launcher, or a plain `torchrun` on every node (README).

It imports nothing heavy before it can take a stop: the launcher forwards Ctrl-C (SIGINT) to
every rank, often while one still imports torch, and a KeyboardInterrupt there printed each
rank's traceback under the run's one line. A rank stopped that early exits 130 without a word,
as one stopped later does (`worker.main`); the launcher says once that the run was
interrupted. The rank also stops itself once its launcher is gone (`leave_with_launcher`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

LAUNCHER_POLL_S = 1.0
"""How often a rank looks whether its launcher is still there (`leave_with_launcher`)."""


def leave_with_launcher() -> None:
    """Stop this rank (exit 1, with a line saying why) once the process that launched it is
    gone: a launcher killed by SIGKILL (the OOM killer, a scheduler) or by a signal torch's
    agent does not handle (SIGUSR1) cannot stop its ranks, which went on training and
    writing checkpoints under init. A rank re-parented to another process has lost it."""
    launcher = os.getppid()
    rank = os.environ.get("RANK", "?")

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(LAUNCHER_POLL_S)
        # one write: the ranks share the launcher's stderr
        sys.stderr.write(f"error: rank {rank}: its launcher (pid {launcher}) is gone; "
                         "stopping\n")
        sys.stderr.flush()
        os._exit(1)

    threading.Thread(target=watch, name="spindle-launcher-watch", daemon=True).start()


def start() -> int:
    """Run the rank (`worker.main`); its exit code, 130 when stopped while it still imports.
    `spindle run` starts ranks with SIGINT blocked (`cli.run`), so that one arriving while the
    interpreter itself starts (a 'Fatal Python error' there) waits until here."""
    try:
        from spindle_cli.runtime import worker

        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    except KeyboardInterrupt:
        return 130
    return worker.main()


if __name__ == "__main__":
    leave_with_launcher()
    code = start()
    # a rank leaves at once, its lines and files written, without interpreter shutdown: that
    # destroys torch's objects late, and gloo's threads abort the process ('terminate called
    # without an active exception', SIGABRT) when still waiting on a lost peer after a failure,
    # and, with every group destroyed, after 1 in 40 successful 2-rank runs on a loaded machine
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
