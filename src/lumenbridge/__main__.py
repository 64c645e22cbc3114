"""`python -m lumenbridge` runs the command-line interface."""

from lumenbridge.cli import main

raise SystemExit(main())
