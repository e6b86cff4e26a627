"""`python -m tt_moge.bench_breakdown`: the per-stage latency benchmark under its published name (`tt-moge bench`)."""

import sys

from .cli.bench import main

if __name__ == "__main__":
    sys.exit(main())
