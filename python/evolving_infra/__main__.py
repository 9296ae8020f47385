"""`python -m evolving_infra`: the same as the `evolving-infra` command."""

import sys

from evolving_infra.cli import main

sys.exit(main())
