"""OpenMP's wait policy (`tt_moge.openmp`): `import tt_moge` before torch makes torch's OpenMP runtime passive (its
waiting threads sleep at once), the caller's own setting wins, and a process that imported torch first is told
that it runs with OpenMP's default. Checked on the runtime itself: libgomp prints the spin count it uses with
OMP_DISPLAY_ENV=VERBOSE (0 when passive, 300000 by default), so the tests fail if the variable is set too late
for the runtime to read it, not only if it is missing from os.environ."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tt_moge import openmp

SCRIPT = """
import json, os, sys
order = sys.argv[1].split(",")
for name in order:
    __import__(name)
import torch, tt_moge
torch.ones(64, 64) @ torch.ones(64, 64)  # the OpenMP runtime is up
print(json.dumps({"env": os.environ.get("OMP_WAIT_POLICY"), "decision": tt_moge.openmp.describe(),
                  "child": tt_moge.openmp.environment_before().get("OMP_WAIT_POLICY")}))
"""


def run(order: str, **extra: str) -> tuple:
    """(the runtime's spin count, what the child reported) for a child that imports `order` first."""
    env = {k: v for k, v in os.environ.items() if k not in openmp.USER_VARIABLES}
    env.update(extra, OMP_DISPLAY_ENV="VERBOSE")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, order], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    found = re.search(r"GOMP_SPINCOUNT = '(\d+)'", out.stderr)
    assert found, f"torch's OpenMP runtime did not report its spin count (not libgomp?):\n{out.stderr[-2000:]}"
    return int(found.group(1)), json.loads(out.stdout.strip().splitlines()[-1])


def test_import_before_torch_makes_the_runtime_passive():
    spin, child = run("tt_moge")
    assert spin == 0
    assert child["env"] == "PASSIVE" and child["decision"]["set_by"] == "tt_moge"
    assert child["child"] is None  # a process that should run as users run other programs gets OpenMP's default


def test_torch_imported_first_keeps_the_default_and_says_so():
    spin, child = run("torch")
    assert spin == 300000  # libgomp's default: spin, then sleep
    assert child["env"] is None  # not set after the fact, where it would claim a policy the runtime never read
    assert "torch was imported before tt_moge" in child["decision"]["set_by"]


@pytest.mark.parametrize(
    "variable, value, spin", [("GOMP_SPINCOUNT", "1234", 1234), ("OMP_WAIT_POLICY", "ACTIVE", None)]
)
def test_the_callers_setting_wins(variable, value, spin):
    got, child = run("tt_moge", **{variable: value})
    if spin is not None:
        assert got == spin
    else:
        assert got > 300000  # ACTIVE: libgomp spins far longer than its default
    assert child["decision"] == {"set_by": "environment", variable: value}
    assert child["child"] == (value if variable == "OMP_WAIT_POLICY" else None)


def test_cpu_model_info_reports_the_policy(tiny_model):
    assert tiny_model.info()["openmp_wait"] == openmp.describe()
    assert openmp.describe()["set_by"]  # decided at import, whichever way
