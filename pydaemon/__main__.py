"""`python -m pydaemon ...` is `pagedd ...`."""

from pydaemon.entrypoints.cli import main

raise SystemExit(main())
