"""`python -m tinypipe.cli`: the `tinypipe` command."""

from tinypipe.cli import main

raise SystemExit(main())
