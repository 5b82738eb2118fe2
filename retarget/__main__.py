"""`python -m retarget`: the same command line as the `retarget` console script."""

from retarget.cli.main import main

raise SystemExit(main())
