"""The `lumenbridge` command and `python -m lumenbridge`.

Importing the command line loads torch, which takes seconds; a Ctrl-C in
that time gets the same one-line answer and exit code (130) as one during a
run, instead of a traceback from deep inside torch."""

import sys


def main() -> int:
    try:
        from lumenbridge.cli import main as run
    except KeyboardInterrupt:
        print("lumenbridge: interrupted", file=sys.stderr)
        return 130
    return run()


if __name__ == "__main__":
    raise SystemExit(main())
