"""`python -m pydaemon ...` is `pagedd ...`."""

from pydaemon.cli import main

raise SystemExit(main())
