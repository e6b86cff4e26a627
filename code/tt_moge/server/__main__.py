"""`python -m tt_moge.server --weights PATH_OR_REPO [--host 127.0.0.1 --port 8000 ...]` (same flags as `tt-moge serve`)."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .cli import EXIT_CODES, add_arguments, run


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tt_moge.server",
                                     description="Serve MoGe-2 over HTTP: POST an image to /predict, get an npz back.",
                                     epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
