"""One environment prefix: tt_moge reads MOGE_* names (tt_moge/env.py); the old TT_MOGE_* names of the renamed
variables still work, with a DeprecationWarning naming the new one, and the new name wins when both are set."""

from __future__ import annotations

import subprocess
import warnings
from pathlib import Path

import pytest

from tt_moge import env

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(env, "_warned", set())  # each test sees the first read of an old name


def test_the_new_name_is_read_without_a_warning(monkeypatch):
    monkeypatch.setenv("MOGE_TTNN_TRACE", "0")
    monkeypatch.setenv("TT_MOGE_TTNN_TRACE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert env.get("MOGE_TTNN_TRACE") == "0"


@pytest.mark.parametrize("new, old", sorted(env.RENAMED.items()))
def test_an_old_name_is_still_read_with_a_deprecation_warning(monkeypatch, new, old):
    monkeypatch.delenv(new, raising=False)
    monkeypatch.setenv(old, "some value")
    with pytest.warns(DeprecationWarning, match=rf"\${old} is deprecated: set \${new} instead"):
        assert env.get(new) == "some value"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per name and process
        assert env.get(new) == "some value"


def test_unset_gives_the_default_and_other_prefixes_are_refused(monkeypatch):
    monkeypatch.delenv("MOGE_CXX", raising=False)
    assert env.get("MOGE_CXX") is None and env.get("MOGE_CXX", "g++") == "g++"
    with pytest.raises(ValueError, match=r"named MOGE_\*, got 'TT_MOGE_TTNN_TRACE'"):
        env.get("TT_MOGE_TTNN_TRACE")


def test_the_library_reads_the_renamed_variables_under_both_names(monkeypatch):
    from tt_moge.runners import cpu

    monkeypatch.setattr(cpu, "_malloc_tuned", False)
    monkeypatch.delenv("MOGE_CPU_MALLOC_TUNING", raising=False)
    monkeypatch.setenv("TT_MOGE_CPU_MALLOC_TUNING", "0")
    with pytest.warns(DeprecationWarning, match="MOGE_CPU_MALLOC_TUNING"):
        assert cpu.keep_freed_memory() is False  # the old name's "0" still opts out
    monkeypatch.setenv("MOGE_CPU_MALLOC_TUNING", "0")
    monkeypatch.delenv("TT_MOGE_CPU_MALLOC_TUNING")
    assert cpu.keep_freed_memory() is False


def test_tt_mock_check_reads_the_old_name_with_a_note(tmp_path):
    env_vars = {"PATH": "/usr/bin:/bin", "TT_MOGE_MOCK_DIR": str(tmp_path)}
    done = subprocess.run(
        [str(ROOT / "scripts" / "tt-mock-check"), "--help"], capture_output=True, text=True, env=env_vars
    )
    assert done.returncode == 0 and "mock Blackhole P150" in done.stdout, done
    assert "$TT_MOGE_MOCK_DIR is deprecated: set $MOGE_MOCK_DIR instead" in done.stderr
    done = subprocess.run(
        [str(ROOT / "scripts" / "tt-mock-check"), "--help"],
        capture_output=True,
        text=True,
        env={**env_vars, "MOGE_MOCK_DIR": str(tmp_path)},
    )
    assert done.returncode == 0 and done.stderr == ""


def test_the_mock_setup_reads_the_old_names_with_a_note(tmp_path):
    """setup.sh's own lines for the rename, run on their own (the whole script installs the mock)."""
    lines = (ROOT / "scripts" / "tt-mock" / "setup.sh").read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if "TT_MOGE_MOCK_DIR:-" in line)
    end = next(i for i, line in enumerate(lines) if line.startswith("TTNN_VERSION="))
    snippet = "set -u\n" + "".join(lines[start : end + 1]) + 'echo "$WORK $TTNN_VERSION"\n'
    old = {"PATH": "/usr/bin:/bin", "TT_MOGE_MOCK_DIR": str(tmp_path), "TT_MOGE_TTNN_VERSION": "9.9"}
    done = subprocess.run(["bash", "-c", snippet], capture_output=True, text=True, env=old)
    assert done.returncode == 0 and done.stdout.split() == [str(tmp_path), "9.9"], done
    assert "$TT_MOGE_MOCK_DIR is deprecated: set $MOGE_MOCK_DIR instead" in done.stderr
    assert "$TT_MOGE_TTNN_VERSION is deprecated: set $MOGE_TTNN_VERSION instead" in done.stderr
    new = {**old, "MOGE_MOCK_DIR": "/new", "MOGE_TTNN_VERSION": "1.0"}
    done = subprocess.run(["bash", "-c", snippet], capture_output=True, text=True, env=new)
    assert done.stdout.split() == ["/new", "1.0"] and done.stderr == ""


def test_a_setting_holds_for_its_block_and_is_put_back(monkeypatch):
    monkeypatch.setenv("MOGE_CPU_KERNELS", "attention=sdpa")
    monkeypatch.delenv("MOGE_HOST", raising=False)
    with env.setting("MOGE_CPU_KERNELS", "vit_linear=aten"), env.setting("MOGE_HOST", "torch"):
        assert env.get("MOGE_CPU_KERNELS") == "vit_linear=aten" and env.get("MOGE_HOST") == "torch"
        with env.setting("MOGE_HOST", None):  # None: as it is
            assert env.get("MOGE_HOST") == "torch"
    assert env.get("MOGE_CPU_KERNELS") == "attention=sdpa" and env.get("MOGE_HOST") is None
    with pytest.raises(RuntimeError), env.setting("MOGE_HOST", "torch"):
        raise RuntimeError  # put back on an exception too
    assert env.get("MOGE_HOST") is None
    with pytest.raises(ValueError, match="MOGE_"), env.setting("HOME", "/"):
        pass
