"""OpenMP's wait policy for torch's CPU threads: passive (idle threads sleep), set before torch loads its runtime.

torch's CPU operators run on an OpenMP team (the libgomp that torch's wheel bundles). When a thread of the team
has finished its share of an operator, OpenMP's default lets it spin for a while (libgomp: 300,000 turns) before
it sleeps, so that the next operator starts without a wake-up. On a quiet machine that buys nothing measurable
for MoGe's forward: its operators are large. On a machine whose cores other processes share, the spinning
threads take the cores that the team's late thread (descheduled by the OS) needs to reach the barrier, and a
2-thread forward can lose to a 1-thread one. With `OMP_WAIT_POLICY=PASSIVE` a waiting thread sleeps at once;
docs/performance.md has the measurements (`python -m perf.runners.bench_cpu --busy`).

OpenMP reads the policy once, when its library is loaded (that is, when torch is first imported), and offers no
call to change it later. So `import tt_moge` sets `OMP_WAIT_POLICY=PASSIVE` in `os.environ` (which child
processes inherit too) when both hold:
* torch is not imported yet (else the runtime has read its settings already and the variable would lie);
* the caller has not set OMP_WAIT_POLICY, GOMP_SPINCOUNT (libgomp) or KMP_BLOCKTIME (LLVM's and Intel's
  OpenMP) itself: the caller's choice always wins (`GOMP_SPINCOUNT=300000` restores libgomp's default).
`describe()` says which of these decided it; a CPU model reports it in `model.info()["openmp_wait"]`.

This module imports nothing heavy: it runs at `import tt_moge`.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

__all__ = ["POLICY", "DEFAULT", "USER_VARIABLES", "set_wait_policy", "describe", "environment_before"]

POLICY = "PASSIVE"
DEFAULT = "OpenMP's default (threads spin before they sleep)"
USER_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")

_decision: Optional[dict] = None  # set once, by tt_moge/__init__.py (which runs before this module can be used)


def set_wait_policy() -> dict:
    """Set OMP_WAIT_POLICY=PASSIVE where that is still possible and wanted (see the module's docstring); once per
    process. Returns `describe()`."""
    global _decision
    if _decision is None:
        given = {name: os.environ[name] for name in USER_VARIABLES if name in os.environ}
        if given:
            _decision = {"set_by": "environment", **given}
        elif "torch" in sys.modules:
            _decision = {"set_by": f"torch was imported before tt_moge: {DEFAULT}"}
        else:
            os.environ["OMP_WAIT_POLICY"] = POLICY
            _decision = {"set_by": "tt_moge", "OMP_WAIT_POLICY": POLICY}
    return describe()


def describe() -> dict:
    """How OpenMP's wait policy of this process came about: {"set_by": ..., and the variables in effect}."""
    return dict(_decision)


def environment_before() -> dict:
    """os.environ as it would be without tt_moge's setting: for a child process that should run as users run
    other programs (the benchmarks' upstream side)."""
    child = dict(os.environ)
    if _decision["set_by"] == "tt_moge":  # the only case in which tt_moge set anything
        child.pop("OMP_WAIT_POLICY", None)
    return child
