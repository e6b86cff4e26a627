"""`python -m tt_moge ...` is the `tt-moge` command."""

import sys

from .cli import main

sys.exit(main())
