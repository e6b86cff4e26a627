"""Fast npz encoding: a standard numpy `.npz` (a zip of `.npy` members), the large maps deflated by ISA-L.

`np.savez_compressed` deflates with zlib level 6 (slow, for a few per cent fewer bytes than level 1) and `np.savez`
copies every array several times. The writer below deflates each member once with ISA-L (zlib level 1 without
the `isal` package), takes CRC-32 from ISA-L too (faster than zlib's), and copies each array once. Members
smaller than `MIN_DEFLATE_BYTES` (intrinsics, scalars) are stored: deflate only makes them larger. The result
is an ordinary zip: `np.load`, `zipfile` and `unzip -t` read it. `python -m perf.server.server_bench encode` measures it
(docs/performance.md, Server).
"""

from __future__ import annotations

import io
import struct
import zlib
from typing import Mapping

import numpy as np

try:  # ISA-L: the same deflate format and CRC-32, several times faster than zlib
    from isal import isal_zlib as _zlib

    DEFLATE_BACKEND = "isal"
except ImportError:  # pragma: no cover - the server extra installs isal
    _zlib = zlib
    DEFLATE_BACKEND = "zlib"

__all__ = ["npz_bytes", "npz_parts", "parts_nbytes", "DEFLATE_BACKEND", "DEFLATE_LEVEL", "MIN_DEFLATE_BYTES"]

DEFLATE_LEVEL = 1  # isal has levels 0-3 (zlib 1-9); 1 gave the best size per millisecond on the float maps
MIN_DEFLATE_BYTES = 4096
_ZIP32_LIMIT = 0xFFFFFFFF  # sizes and offsets of a zip without zip64 records
_DOS_DATE, _DOS_TIME = (1 << 5) | 1, 0  # 1980-01-01 00:00: fixed, so equal arrays give equal bytes
_STORED, _DEFLATED = 0, 8


def _npy_parts(array: np.ndarray) -> tuple:
    """(npy header bytes, the array's bytes as a flat uint8 view without a copy when already C-contiguous)."""
    if not array.flags.c_contiguous:  # (np.ascontiguousarray would turn a 0-d array into shape (1,))
        array = array.copy(order="C")
    if array.dtype.hasobject:
        raise ValueError("npz_bytes: object arrays cannot be written without pickles")
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(array))
    return header.getvalue(), array.reshape(-1).view(np.uint8)


def npz_bytes(arrays: Mapping[str, np.ndarray], compress: bool = True) -> bytes:
    """{name: array} -> the bytes of an `.npz` file with members `<name>.npy` (no pickles).

    compress=True deflates members of `MIN_DEFLATE_BYTES` or more; compress=False stores every member.
    Archives of 4 GiB or more are written by numpy's own (slower) writer.
    """
    return b"".join(npz_parts(arrays, compress))


def npz_parts(arrays: Mapping[str, np.ndarray], compress: bool = True) -> list:
    """The bytes of `npz_bytes(arrays, compress)` as a list of buffers whose concatenation is that file.

    Stored members are flat uint8 views of the arrays themselves, not copies: a caller that writes or sends
    the parts one by one never holds a second copy of the maps (the server streams them to the socket, a file
    is written part by part). The views keep the arrays alive; do not modify the arrays while using them.
    """
    chunks: list = []
    directory: list = []
    offset = 0
    for name, value in arrays.items():
        header, data = _npy_parts(np.asanyarray(value))
        size = len(header) + data.nbytes
        crc = _zlib.crc32(data, _zlib.crc32(header))
        if compress and size >= MIN_DEFLATE_BYTES:
            deflater = _zlib.compressobj(DEFLATE_LEVEL, zlib.DEFLATED, -15)
            body = [deflater.compress(header), deflater.compress(data), deflater.flush()]
            method = _DEFLATED
        else:
            body, method = [header, data], _STORED
        packed_size = sum(len(b) if isinstance(b, bytes) else b.nbytes for b in body)
        if max(size, packed_size, offset) >= _ZIP32_LIMIT:
            return [_numpy_npz(arrays, compress)]
        filename = f"{name}.npy".encode()
        fields = struct.pack(
            "<HHHHHIIIHH", 20, 0, method, _DOS_TIME, _DOS_DATE, crc, packed_size, size, len(filename), 0
        )
        local = b"PK\x03\x04" + fields + filename
        chunks += [local, *(b for b in body if len(b))]
        directory.append(
            b"PK\x01\x02" + struct.pack("<H", 20) + fields + struct.pack("<HHHII", 0, 0, 0, 0, offset) + filename
        )
        offset += len(local) + packed_size
    central = b"".join(directory)
    if offset + len(central) >= _ZIP32_LIMIT or len(directory) > 0xFFFF:
        return [_numpy_npz(arrays, compress)]
    end = b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, len(directory), len(directory), len(central), offset, 0)
    return chunks + [central, end]


def parts_nbytes(parts: list) -> int:
    """Total bytes of a list of buffers (bytes or numpy views)."""
    return sum(p.nbytes if isinstance(p, np.ndarray) else len(p) for p in parts)


def _numpy_npz(arrays: Mapping[str, np.ndarray], compress: bool) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compress else np.savez)(buf, **arrays)
    return buf.getvalue()
