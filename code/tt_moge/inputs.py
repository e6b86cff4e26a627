"""Turn command-line inputs (files, folders, glob patterns) into a list of images, each with its own output
folder name. Shared by `tt-moge predict` and batch jobs, so that both lay out results the same way.

Rules:
* a file is taken as given (any extension: it is decoded, or reported as unreadable); its name is its stem;
* a folder is searched recursively for IMAGE_EXTENSIONS (case-insensitive); a file's name is its path
  relative to the folder, without the extension (`photos/trip/a.jpg` -> `trip/a`), so the tree is mirrored;
* anything else is a glob pattern (`**` recurses); matching files are taken like files, matching folders
  like folders. A pattern that matches nothing, or a path that does not exist, is an InputPathError.
The same file named twice (e.g. a folder and a file in it) is taken once, first mention first. Files below
`exclude` (the output folder) are skipped in folder and pattern matches, so `tt-moge predict .` run twice does
not take its own depth.png files as photos.

Names stay inside the output folder and never take the place of the run's own files (`output_name`): in each
'/'-separated part, control characters (a newline, a tab, ...) and backslashes become "_", and a part that is
empty or only dots ("." from `..png`, ".." from `...png`) becomes as many "_"; a first part that is one of the
run's own names (`runs.RESERVED_NAMES`: run.json, batch.json, failures.jsonl, parquet; any case) or hidden (a
leading ".") gets a "_" in front (`_run.json`). Then names that collide (case-insensitively, as on macOS and
Windows), or that equal a folder another name needs, get the extension appended (`a_jpg`), then a counter
(`a_jpg-2`), in input order: names are unique and stable. Each renamed input says why (`ImageInput.renamed`).
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterable, Optional, Sequence, Union

from .runs import is_reserved

__all__ = [
    "IMAGE_EXTENSIONS",
    "ImageInput",
    "InputPathError",
    "collect_images",
    "asked_name",
    "output_name",
    "unique_names",
    "NAME_MAX",
    "unreadable_images",
]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")
# The most bytes of one name in a path on the usual file systems (ext4, XFS, Btrfs, tmpfs, APFS, NTFS: 255): a name
# made longer by a clash's suffix is cut to it before the suffix
NAME_MAX = 255


class InputPathError(ValueError):
    """An input argument names nothing that exists or matches."""


@dataclass(frozen=True)
class ImageInput:
    path: Path  # the file to read
    name: str  # its output folder, relative to the output root, '/'-separated
    wanted: str = ""  # the name its path asks for (`asked_name`)
    renamed: str = ""  # why `name` is not `wanted` ("" when it is)


_UNSAFE = re.compile(r"[\x00-\x1f\x7f\\]")  # control characters and backslashes (a separator on Windows)


def asked_name(path: Union[str, os.PathLike], base: Optional[Union[str, os.PathLike]] = None) -> str:
    """The output name an input file asks for: its path relative to the folder `base` it was found in, without
    the extension, '/'-separated (`photos/trip/a.jpg` below `photos` -> `trip/a`); without `base`, its stem.
    Not yet safe: see `output_name`."""
    relative = PurePosixPath(Path(path).relative_to(base).as_posix() if base is not None else Path(path).name)
    return relative.as_posix()[: len(relative.as_posix()) - len(relative.suffix)]  # "...png" -> "..", as pathlib


def output_name(path: Union[str, os.PathLike], base: Optional[Union[str, os.PathLike]] = None) -> tuple:
    """The one mapping from an input file to its output folder: (name, why it is not `asked_name`, or "").

    The name is a relative path that stays inside the output folder and is none of the run's own files (the
    rules are in the module docstring); `collect_images` then makes the names of one run unique."""
    parts = asked_name(path, base).split("/")
    why = []
    for i, part in enumerate(parts):
        safe = _UNSAFE.sub("_", part)
        if safe != part:
            why.append(f"{part!r} has control characters or backslashes")
        if not safe.strip("."):
            safe = "_" * max(1, len(safe))
            why.append(f"{part!r} is not a folder name")
        parts[i] = safe
    if is_reserved(parts[0]):
        why.append(f"{parts[0]!r} is a name of the run's own files (or hidden)")
        parts[0] = "_" + parts[0]
    return "/".join(parts), "; ".join(why)


def _is_image(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_EXTENSIONS and path.is_file()


def _folder_images(folder: Path) -> list:
    found = [p for p in folder.rglob("*") if _is_image(p)]
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def _outside(path: Path, exclude: Optional[str]) -> bool:
    return exclude is None or os.path.commonpath([os.path.realpath(path), exclude]) != exclude


def _expand(argument: str, exclude: Optional[str]) -> list:
    """One argument -> [(path, the folder it was found in, or None)]."""
    path = Path(argument).expanduser()
    if path.is_file():
        return [(path, None)]
    if path.is_dir():
        return [(p, path) for p in _folder_images(path) if _outside(p, exclude)]
    if glob.has_magic(argument):
        matches = sorted(glob.glob(os.path.expanduser(argument), recursive=True))
        out: list = []
        for match in map(Path, matches):
            if match.is_dir():
                out += _expand(str(match), exclude)
            elif match.is_file() and _outside(match, exclude):
                out.append((match, None))
        if not out:
            raise InputPathError(f"input {argument!r}: the pattern matches no files")
        return out
    raise InputPathError(f"input {argument!r}: no such file or folder")


def unique_names(wanted: Sequence[tuple]) -> list:
    """[(path, safe name, why renamed)] -> [(name, why renamed)]: names unique case-insensitively and never a
    parent folder of another name (a clash gets the path's extension, then a counter). The one way a run's
    names are made unique: photos (`collect_images`) and clips (`tt-moge predict a.mp4 a.mov`) alike."""

    def parents(name: str) -> list:
        return [p.as_posix().casefold() for p in PurePosixPath(name).parents if p.as_posix() != "."]

    def fitted(name: str, suffix: str) -> str:
        """name + suffix, the last part of name cut first (at a character) so that the part is NAME_MAX bytes
        at most: two 251-byte stems that clash became 257 bytes, and their files could not be written."""
        nonlocal cut
        head, _, last = name.rpartition("/")
        kept = last.encode()[: NAME_MAX - len(suffix.encode())].decode(errors="ignore")
        cut = cut or kept != last
        return f"{head}/" * bool(head) + kept + suffix

    counts: dict = {}
    for _, name, _ in wanted:
        counts[name.casefold()] = counts.get(name.casefold(), 0) + 1
    folders = {p for _, name, _ in wanted for p in parents(name)}
    taken: set = set()
    names = []
    for path, name, why in wanted:
        key, reasons, cut = name.casefold(), [why] if why else [], False
        if counts[key] > 1 or key in folders:
            suffix = path.suffix.lstrip(".")
            name = fitted(name, f"_{suffix}") if suffix else name
            reasons.append(
                f"another input asks for {key!r} too" if counts[key] > 1 else f"{key!r} is a folder of another name"
            )
        base, n = name, 1
        while name.casefold() in taken or name.casefold() in folders:
            n += 1
            name = fitted(base, f"-{n}")
        if n > 1 and len(reasons) == (1 if why else 0):
            reasons.append(f"{base!r} is taken")
        if cut:
            reasons.append(f"cut to fit {NAME_MAX} bytes, a file system's limit on a name")
        taken.add(name.casefold())
        names.append((name, "; ".join(reasons)))
    return names


def collect_images(arguments: Iterable[str], exclude: Optional[Union[str, os.PathLike]] = None) -> list:
    """Input arguments -> [ImageInput] in a stable order (arguments in order, folder contents sorted), each with
    its own output folder name (`output_name`, made unique). Files below the folder `exclude` are skipped in
    folder and pattern matches (not when named directly)."""
    excluded = None if exclude is None else os.path.realpath(exclude)
    found: list = []
    seen: set = set()
    for argument in arguments:
        for path, base in _expand(os.fspath(argument), excluded):
            key = os.path.realpath(path)
            if key not in seen:
                seen.add(key)
                found.append((path, base))
    safe = [(path, *output_name(path, base)) for path, base in found]
    return [
        ImageInput(path, name, asked_name(path, base), why)
        for (path, base), (name, why) in zip(found, unique_names(safe))
    ]


def unreadable_images(images: Sequence[ImageInput]) -> dict:
    """{index: reason} of the images whose file is not an image by its header (or is missing), checked without
    decoding: a run reports them before it loads a model, and loads none when no image is left."""
    from .host.decode import InputError, read_image_header

    bad: dict = {}
    for index, image in enumerate(images):
        try:
            read_image_header(image.path)
        except InputError as exc:
            bad[index] = str(exc)
    return bad
