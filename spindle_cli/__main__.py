"""`python -m spindle_cli` and the `spindle` command (`run`)."""

import sys


def run() -> None:
    """The CLI (`cli.main`), ended by Ctrl-C as the CLI ends it even while it loads: Ctrl-C in
    its first half second (importing click, rich, numpy) printed a KeyboardInterrupt
    traceback."""
    try:
        from spindle_cli.cli import main
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted by SIGINT\n")
        sys.exit(130)
    main()


if __name__ == "__main__":
    run()
