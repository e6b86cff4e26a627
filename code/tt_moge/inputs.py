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
not take its own depth.png files as photos. Names that
collide (case-insensitively, as on macOS and Windows), or that equal a folder another name needs, get the
extension appended (`a_jpg`), then a counter (`a_jpg-2`), in input order: names are unique and stable.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Iterable, Optional, Sequence, Union

__all__ = ["IMAGE_EXTENSIONS", "ImageInput", "InputPathError", "collect_images", "unreadable_images"]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")


class InputPathError(ValueError):
    """An input argument names nothing that exists or matches."""


@dataclass(frozen=True)
class ImageInput:
    path: Path  # the file to read
    name: str  # its output folder, relative to the output root, '/'-separated


def _is_image(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_EXTENSIONS and path.is_file()


def _folder_images(folder: Path) -> list:
    found = [p for p in folder.rglob("*") if _is_image(p)]
    return sorted(found, key=lambda p: p.relative_to(folder).as_posix())


def _outside(path: Path, exclude: Optional[str]) -> bool:
    return exclude is None or os.path.commonpath([os.path.realpath(path), exclude]) != exclude


def _expand(argument: str, exclude: Optional[str]) -> list:
    """One argument -> [(path, wanted name)]."""
    path = Path(argument).expanduser()
    if path.is_file():
        return [(path, path.stem)]
    if path.is_dir():
        return [
            (p, PurePosixPath(p.relative_to(path).as_posix()).with_suffix("").as_posix())
            for p in _folder_images(path)
            if _outside(p, exclude)
        ]
    if glob.has_magic(argument):
        matches = sorted(glob.glob(os.path.expanduser(argument), recursive=True))
        out: list = []
        for match in map(Path, matches):
            if match.is_dir():
                out += _expand(str(match), exclude)
            elif match.is_file() and _outside(match, exclude):
                out.append((match, match.stem))
        if not out:
            raise InputPathError(f"input {argument!r}: the pattern matches no files")
        return out
    raise InputPathError(f"input {argument!r}: no such file or folder")


def _unique_names(wanted: Sequence[tuple]) -> list:
    """[(path, wanted name)] -> names, unique case-insensitively and never a parent folder of another name."""

    def parents(name: str) -> list:
        return [p.as_posix().casefold() for p in PurePosixPath(name).parents if p.as_posix() != "."]

    counts: dict = {}
    for _, name in wanted:
        counts[name.casefold()] = counts.get(name.casefold(), 0) + 1
    folders = {p for _, name in wanted for p in parents(name)}
    taken: set = set()
    names = []
    for path, name in wanted:
        key = name.casefold()
        if counts[key] > 1 or key in folders:
            suffix = path.suffix.lstrip(".")
            name = f"{name}_{suffix}" if suffix else name
        base, n = name, 1
        while name.casefold() in taken or name.casefold() in folders:
            n += 1
            name = f"{base}-{n}"
        taken.add(name.casefold())
        names.append(name)
    return names


def collect_images(arguments: Iterable[str], exclude: Optional[Union[str, os.PathLike]] = None) -> list:
    """Input arguments -> [ImageInput] in a stable order (arguments in order, folder contents sorted).
    Files below the folder `exclude` are skipped in folder and pattern matches (not when named directly)."""
    excluded = None if exclude is None else os.path.realpath(exclude)
    wanted: list = []
    seen: set = set()
    for argument in arguments:
        for path, name in _expand(os.fspath(argument), excluded):
            key = os.path.realpath(path)
            if key not in seen:
                seen.add(key)
                wanted.append((path, name))
    return [ImageInput(path, name) for (path, _), name in zip(wanted, _unique_names(wanted))]


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
