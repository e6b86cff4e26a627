#!/usr/bin/env bash
# Sets up (or reuses) a mock Tenstorrent Blackhole P150 for ttnn on a machine without Tenstorrent hardware:
# a Python 3.12 venv with ttnn (PyPI), GNU binutils for RISC-V (Debian package), this folder's stub compiler
# driver inside the venv's ttnn, the P150 cluster descriptor, and WORK/env.sh to source.
#
#   bash scripts/tt-mock/setup.sh [WORK]     WORK defaults to $MOGE_MOCK_DIR or ~/.cache/tt_moge/tt-mock
#
# On the mock every ttnn op runs its real validation, program creation and L1 / circular-buffer / DRAM
# allocation; kernels are not compiled (the stub writes empty objects), so read-back values are zeros.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
if [ -z "${MOGE_MOCK_DIR:-}" ] && [ -n "${TT_MOGE_MOCK_DIR:-}" ]; then  # the old name, still read
  echo "tt-mock: \$TT_MOGE_MOCK_DIR is deprecated: set \$MOGE_MOCK_DIR instead" >&2; MOGE_MOCK_DIR="$TT_MOGE_MOCK_DIR"
fi
if [ -z "${MOGE_TTNN_VERSION:-}" ] && [ -n "${TT_MOGE_TTNN_VERSION:-}" ]; then  # the old name, still read
  echo "tt-mock: \$TT_MOGE_TTNN_VERSION is deprecated: set \$MOGE_TTNN_VERSION instead" >&2; MOGE_TTNN_VERSION="$TT_MOGE_TTNN_VERSION"
fi
WORK="${1:-${MOGE_MOCK_DIR:-$HOME/.cache/tt_moge/tt-mock}}"
TTNN_VERSION="${MOGE_TTNN_VERSION:-0.81.1}"  # the newest ttnn on PyPI with cp312 wheels when this was written
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
STAMP="$WORK/.ready-ttnn-$TTNN_VERSION-$(cat "$HERE/riscv-tt-elf-g++" "$HERE/tt-mock-stub.S" "$HERE/blackhole_P150.yaml" | sha1sum | cut -c1-12)"
if [ -f "$STAMP" ] && [ -x "$WORK/venv/bin/python" ]; then
  echo "tt-mock: reusing $WORK"; exit 0
fi

# 1. a Python 3.12: ttnn has wheels for CPython 3.10 and 3.12 only
find_python() {
  if [ -n "${PY:-}" ]; then echo "$PY"; return; fi
  for candidate in python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
    if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then echo "$candidate"; return; fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    local found
    found="$(ls -d "$(pyenv root)"/versions/3.12* 2>/dev/null | tail -1 || true)"
    if [ -n "$found" ] && [ -x "$found/bin/python" ]; then echo "$found/bin/python"; return; fi
  fi
  return 1
}
PYTHON312="$(find_python)" || { echo "tt-mock: no Python 3.12 found (ttnn $TTNN_VERSION needs 3.10 or 3.12): set PY=/path/to/python3.12" >&2; exit 1; }

# 2. GNU ld / as for RISC-V (the stub links with tt-metal's own linker scripts)
if ! command -v riscv64-unknown-elf-ld >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq binutils-riscv64-unknown-elf >/dev/null
  else
    echo "tt-mock: needs riscv64-unknown-elf-ld: sudo apt-get install binutils-riscv64-unknown-elf" >&2; exit 1
  fi
fi

# 3. the venv and ttnn (numpy<2 comes with it; no torch: the check runs on numpy arrays)
[ -x "$WORK/venv/bin/python" ] || "$PYTHON312" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q --disable-pip-version-check "ttnn==$TTNN_VERSION"

# 4. the stub compiler where tt-metal looks for the SFPI toolchain (<ttnn>/runtime/sfpi/compiler/bin)
TTNN_DIR="$("$WORK/venv/bin/python" -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("ttnn").origin))')"
BIN="$TTNN_DIR/runtime/sfpi/compiler/bin"
mkdir -p "$BIN"
if [ -e "$BIN/riscv-tt-elf-g++" ] && ! grep -q "tt_moge mock stub" "$BIN/riscv-tt-elf-g++"; then
  echo "tt-mock: $BIN holds a real SFPI compiler; not replacing it with the stub" >&2; exit 1
fi
install -m 0755 "$HERE/riscv-tt-elf-g++" "$BIN/riscv-tt-elf-g++"
riscv64-unknown-elf-as -march=rv32i -mabi=ilp32 "$HERE/tt-mock-stub.S" -o "$BIN/tt-mock-stub.o"
cp "$HERE/blackhole_P150.yaml" "$WORK/blackhole_P150.yaml"

cat > "$WORK/env.sh" <<ENV
# source this to run ttnn on the mock P150 (made by tt_moge's scripts/tt-mock/setup.sh)
. "$WORK/venv/bin/activate"
export TT_METAL_MOCK_CLUSTER_DESC_PATH="$WORK/blackhole_P150.yaml"
export TT_METAL_CACHE="$WORK/jit-cache"   # stub-built binaries never reach a real kernel cache
export TT_LOGGER_LEVEL="\${TT_LOGGER_LEVEL:-error}"
export LOGURU_LEVEL="\${LOGURU_LEVEL:-WARNING}"
ENV
rm -f "$WORK"/.ready-*
touch "$STAMP"
echo "tt-mock: ready in $WORK (source $WORK/env.sh)"
