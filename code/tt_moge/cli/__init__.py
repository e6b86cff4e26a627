"""The `tt-moge` command line: `main` dispatches to one module per command (predict, batch, info, serve,
bench); `common` defines what they share (the model flags, once)."""

from .entry import build_parser, main

__all__ = ["build_parser", "main"]
