"""`python -m tt_moge.server --weights PATH_OR_REPO [--host 127.0.0.1 --port 8000 ...]`: `tt-moge serve`."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from ..cli.serve import build_parser, run


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run(build_parser("python -m tt_moge.server").parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
