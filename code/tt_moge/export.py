"""Files people expect from a depth model, written from one MoGeOutput and the RGB image it came from.

`write_outputs(output, image_rgb, out_dir, formats)` writes one image's folder; the CLI, the quickstart and the
batch job all call it. Format groups (`FORMATS`; `DEFAULT_FORMATS` when none is chosen) and the files they write:

| group  | files                                          | written with                                   |
|--------|------------------------------------------------|------------------------------------------------|
| maps   | depth.png (colourised, with a depth colour     | OpenCV (colour map, text, PNG)                 |
|        | bar), normal.png, mask.png,                    |                                                |
|        | depth.exr (float32 metres, channel "Y")        | OpenEXR (the ASWF `OpenEXR` Python bindings)   |
| npz    | result.npz (the server layout, NPZ_LAYOUT,     | numpy, via MoGeOutput.save_npz                 |
|        | maps deflated)                                 |                                                |
| ply    | points.ply (binary; xyz, normal, RGBA)         | trimesh                                        |
| glb    | mesh.glb (every `mesh_step`-th pixel; the      | trimesh (+ Pillow for the texture PNG)         |
|        | full image as texture)                         |                                                |
| always | result.json (camera, scale, statistics, files) | json; written last, so it marks a complete one |

Depth as EXR, not 16-bit PNG: float32 keeps the depth bit-identical to result.npz, with no 65.535 m ceiling,
no 1 mm steps and `inf` for invalid pixels; it is the format upstream MoGe writes and Blender, Nuke and
OpenCV read.

3D exports use glTF / OpenGL axes (x right, y up, z towards the viewer), i.e. the camera-space point
(x, y, z) of MoGeOutput (OpenCV axes) becomes (x, -y, -z), and so do the normals; the camera sits at the
origin looking down -z. They hold one vertex per *kept* pixel, in row-major order: a valid pixel that is not
on a depth edge (`depth_edges`). The mesh joins neighbouring kept pixels with two triangles per pixel quad
(top-left, bottom-left, top-right) and (top-right, bottom-left, bottom-right), each only where all three of
its corners are kept; since a quad with a depth jump has all four corners on the edge, no triangle spans a
discontinuity larger than DEPTH_EDGE_RTOL of its nearest depth. Triangles face the camera (counter-clockwise).
The mesh may sample the image on a coarser grid, every `mesh_step`-th row and column (`image_mesh(step=...)`):
it is then the mesh of that sub-sampled output, by the same rules, and its UVs still address the full image.
The point cloud always has every kept pixel.

The CLI's defaults (`DEFAULT_FORMATS`: the maps and the mesh, `DEFAULT_MESH_STEP`: every second pixel) are
sized for folders of many photos: the npz and the point cloud, and a full-resolution mesh, are each several
times the size of the maps (`python -m perf.cli.export_bench` measures every format). The CLI's default mesh
is also bounded (`mesh_faces=MESH_FACE_BUDGET`, `mesh_step_for`): a 24 MP photo at step 2 would be 12 M faces
and a quarter of a GB; the step grows until the grid has at most about 1 M faces (a 1920x1080 photo keeps
step 2). A photo too small for any triangle (16x16 at step 2, all on depth edges) gets no mesh.glb and a note.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import numpy as np

from .constants import DEPTH_EDGE_RTOL
from .output import MoGeOutput, finite_or_none
from .runs import inside

__all__ = [
    "FORMATS",
    "DEFAULT_FORMATS",
    "DEFAULT_MESH_STEP",
    "MESH_FACE_BUDGET",
    "mesh_step_for",
    "FILES",
    "depth_edges",
    "kept_pixels",
    "colorize_depth",
    "colorize_normal",
    "write_depth_exr",
    "point_cloud",
    "image_mesh",
    "to_json",
    "check_formats",
    "missing_format_library",
    "write_outputs",
    "remove_outputs",
    "remove_incomplete",
    "remove_empty_folders",
    "write_text_atomic",
    "RESULT_FILE",
]

# The format groups, in the order they are written, with what each writes (the CLI's --maps/--npz/--ply/--glb).
FORMATS = {
    "maps": "depth.png (colour bar), normal.png, mask.png, depth.exr (float32 metres)",
    "npz": "result.npz: every array, the server's npz layout",
    "ply": "points.ply: coloured point cloud with normals",
    "glb": "mesh.glb: textured mesh, cut at depth discontinuities",
}
DEFAULT_FORMATS = ("maps", "glb")  # what `tt-moge predict` and batch jobs write when no format is chosen
DEFAULT_MESH_STEP = 2  # mesh.glb samples every second row and column: a quarter of the vertices and triangles
# The CLI's default bound on mesh.glb's faces (2^20, "about 1 M"): the most a grid of step 2 has at 1920x1080
# (1,033,802), so that photos up to that size keep DEFAULT_MESH_STEP; larger ones get a coarser step.
MESH_FACE_BUDGET = 2**20
_LIBRARIES = {"maps": ("OpenEXR", "openexr"), "ply": ("trimesh", "trimesh"), "glb": ("trimesh", "trimesh")}
FILES = {
    "maps": ("depth.png", "normal.png", "mask.png", "depth.exr"),
    "npz": ("result.npz",),
    "ply": ("points.ply",),
    "glb": ("mesh.glb",),
}
RESULT_FILE = "result.json"  # written last: its presence marks a complete result
_OPENGL_AXES = np.array([1.0, -1.0, -1.0], dtype=np.float32)  # OpenCV camera axes -> glTF / OpenGL axes
_EXR_CHANNEL = "Y"  # a single-channel EXR as OpenCV writes it: grey-scale readers pick it up


# ------------------------------------------------------------------------------------------ edge rule
def depth_edges(depth: np.ndarray, mask: np.ndarray, rtol: float = DEPTH_EDGE_RTOL) -> np.ndarray:
    """(H, W) bool: valid pixels whose 3x3 neighbourhood (valid neighbours only, image border excluded) spans a
    depth range max - min > rtol * own depth. Computed in float32. Invalid pixels are never edges."""
    import cv2

    depth = np.asarray(depth, dtype=np.float32)
    mask = np.asarray(mask, dtype=bool)
    kernel = np.ones((3, 3), np.uint8)
    # cv2's default border for dilate/erode never wins the max/min, so the image border adds nothing.
    nearest_max = cv2.dilate(np.where(mask, depth, -np.inf).astype(np.float32), kernel)
    nearest_min = cv2.erode(np.where(mask, depth, np.inf).astype(np.float32), kernel)
    with np.errstate(invalid="ignore", over="ignore"):  # +-inf outside the mask; masked out below
        return mask & ((nearest_max - nearest_min) > np.float32(rtol) * depth)


def kept_pixels(output: MoGeOutput, rtol: float = DEPTH_EDGE_RTOL) -> np.ndarray:
    """(H, W) bool: the pixels that become 3D vertices: valid, finite depth, not on a depth edge."""
    valid = output.mask & np.isfinite(output.depth)
    return valid & ~depth_edges(output.depth, valid, rtol)


# ---------------------------------------------------------------------------------------- 2-D maps
def _depth_label(metres: float) -> str:
    return f"{metres:.2f} m" if metres < 10 else f"{metres:.1f} m" if metres < 100 else f"{metres:.0f} m"


def colorize_depth(depth: np.ndarray, mask: np.ndarray, percentiles: Optional[tuple] = None) -> tuple:
    """Depth (H, W) metres -> ((H, W + bar, 3) uint8 RGB picture, (near, far) metres).

    Colours follow inverse depth (turbo colour map, near = red, far = blue) between the 1st and 99th
    percentile of the valid depths (`percentiles`: those two values when the caller has them already);
    invalid pixels are black. A colour bar with depth labels (metres) is drawn to the right. (near, far) is
    (nan, nan) when no pixel is valid."""
    import cv2

    h, w = depth.shape
    valid = mask & np.isfinite(depth)
    picture = np.zeros((h, w, 3), np.uint8)
    if not valid.any():
        return _with_bar(picture, None, None), (math.nan, math.nan)
    near, far = (float(v) for v in (percentiles or np.percentile(depth[valid], [1.0, 99.0])))
    far = max(far, near * (1 + 1e-6) + 1e-9)  # a flat scene still gets a usable range
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (1.0 / depth - 1.0 / far) / (1.0 / near - 1.0 / far)  # 1 at near, 0 at far
    level = np.rint(np.clip(np.nan_to_num(t), 0.0, 1.0) * 255).astype(np.uint8)
    picture[valid] = cv2.applyColorMap(level, cv2.COLORMAP_TURBO)[..., ::-1][valid]
    return _with_bar(picture, near, far), (near, far)


def _with_bar(picture: np.ndarray, near: Optional[float], far: Optional[float]) -> np.ndarray:
    """Append a panel with a vertical colour bar (near at the top) and depth labels in metres."""
    import cv2

    h = picture.shape[0]
    font, scale = cv2.FONT_HERSHEY_SIMPLEX, float(np.clip(h / 900, 0.3, 1.2))
    thick = 1 if scale < 0.8 else 2
    (text_w, text_h), _ = cv2.getTextSize("000.00 m", font, scale, thick)
    margin, bar_w = max(2, h // 100), max(6, h // 30)
    panel = np.full((h, margin * 3 + bar_w + text_w, 3), 255, np.uint8)
    if near is None:
        cv2.putText(panel, "n/a", (margin, min(h - 1, text_h + margin)), font, scale, (0, 0, 0), thick, cv2.LINE_AA)
        return np.concatenate([picture, panel], axis=1)
    ramp = np.rint(np.linspace(255, 0, h)).astype(np.uint8)[:, None].repeat(bar_w, axis=1)
    panel[:, margin : margin + bar_w] = cv2.applyColorMap(ramp, cv2.COLORMAP_TURBO)[..., ::-1]
    ticks = 5 if h >= 5 * (text_h + 4) else 2 if h >= 2 * (text_h + 2) else 1
    for t in np.linspace(1.0, 0.0, ticks):  # the bar is linear in inverse depth, like the picture
        metres = 1.0 / (t * (1.0 / near - 1.0 / far) + 1.0 / far)
        y = int(round((1.0 - t) * (h - 1)))
        baseline = int(np.clip(y + text_h // 2, text_h, h - 1))
        cv2.putText(
            panel, _depth_label(metres), (2 * margin + bar_w, baseline), font, scale, (0, 0, 0), thick, cv2.LINE_AA
        )
    return np.concatenate([picture, panel], axis=1)


def colorize_normal(normal: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Unit normals (H, W, 3), OpenCV camera axes -> (H, W, 3) uint8 RGB normal map in the usual OpenGL
    colours: RGB = ((x, -y, -z) + 1) / 2 * 255, so surfaces facing the camera are blue; invalid pixels black."""
    rgb = np.rint((np.asarray(normal, np.float32) * _OPENGL_AXES + 1.0) * 127.5).clip(0, 255).astype(np.uint8)
    rgb[~mask] = 0
    return rgb


def write_depth_exr(path: Union[str, os.PathLike], depth: np.ndarray) -> None:
    """Depth (H, W) float32 metres -> a single-channel ("Y") float32 EXR, ZIP compressed (lossless)."""
    try:
        import OpenEXR
    except ImportError:
        raise RuntimeError("writing depth.exr needs the OpenEXR package: pip install openexr") from None
    header = {"compression": OpenEXR.ZIP_COMPRESSION, "type": OpenEXR.scanlineimage}
    with OpenEXR.File(header, {_EXR_CHANNEL: np.ascontiguousarray(depth, dtype=np.float32)}) as exr:
        exr.write(os.fspath(path))


def _write_png(path: Path, rgb: np.ndarray) -> None:
    import cv2

    image = rgb[..., ::-1] if rgb.ndim == 3 else rgb  # OpenCV writes BGR
    if not cv2.imwrite(os.fspath(path), np.ascontiguousarray(image)):
        raise OSError(f"could not write {path}")


# --------------------------------------------------------------------------------------------- 3-D
def _as_uint8_rgb(image_rgb: np.ndarray, output: MoGeOutput) -> np.ndarray:
    from .host.decode import float_to_uint8

    rgb = np.asarray(image_rgb)
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.shape[:2] != output.depth.shape:
        w, h = output.size
        raise ValueError(f"image_rgb must be the ({h}, {w}, 3) RGB image of this output, got shape {rgb.shape}")
    return rgb if rgb.dtype == np.uint8 else float_to_uint8(rgb)


def point_cloud(output: MoGeOutput, image_rgb: np.ndarray, keep: Optional[np.ndarray] = None) -> Any:
    """A trimesh.Trimesh without faces: the kept pixels as vertices (OpenGL axes), with the image colours and,
    when the model has a normal head, the predicted normals."""
    import trimesh

    rgb = _as_uint8_rgb(image_rgb, output)
    keep = kept_pixels(output) if keep is None else keep
    normals = None if output.normal is None else output.normal[keep] * _OPENGL_AXES
    return trimesh.Trimesh(
        vertices=output.points[keep] * _OPENGL_AXES,
        faces=np.zeros((0, 3), np.int64),
        vertex_normals=normals,
        vertex_colors=rgb[keep],
        process=False,
        validate=False,
    )


def image_mesh(
    output: MoGeOutput,
    image_rgb: np.ndarray,
    keep: Optional[np.ndarray] = None,
    step: int = 1,
    wrap_columns: bool = False,
    uv_grid: Optional[tuple] = None,
) -> Any:
    """A textured trimesh.Trimesh: the kept pixels as vertices (OpenGL axes), triangles between neighbouring
    kept pixels (see the module docstring), UVs at pixel centres, the image as the base colour texture.

    step: sample every `step`-th row and column, starting at the first; the mesh is that of the sub-sampled
    output (its kept pixels, its triangles), with UVs into the full image. `keep`, when given, is on that grid.
    `uv_grid` = (first, step, (width, height)): the output is already a grid of an image of that size, its
    pixel (i, j) that image's (first + i step, first + j step); the UVs point there (the page's light view).
    `wrap_columns` (panoramas): the last column is also joined to the first, closing the sphere at the seam.
    The seam's triangles take copies of the first column's vertices whose u is one more (past the right edge):
    with glTF's default repeating sampler they show the seam's own strip of texture, not the whole panorama
    squeezed backwards into it."""
    import trimesh
    from PIL import Image

    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be a positive int, got {step!r}")
    rgb = _as_uint8_rgb(image_rgb, output)
    full_h, full_w = output.depth.shape
    depth, points = output.depth[::step, ::step], output.points[::step, ::step]
    normal = None if output.normal is None else output.normal[::step, ::step]
    if keep is None:
        valid = output.mask[::step, ::step] & np.isfinite(depth)
        keep = valid & ~depth_edges(depth, valid)
    h, w = keep.shape
    count = int(keep.sum())
    index = np.full((h, w), -1, dtype=np.int32)  # glTF indices are 32-bit
    index[keep] = np.arange(count, dtype=np.int32)
    rows, cols = np.nonzero(keep)
    vertices = points[keep] * _OPENGL_AXES
    # no kept pixel on the grid (a tiny photo, all on depth edges): trimesh takes no empty normals array
    normals = None if normal is None or not keep.any() else normal[keep] * _OPENGL_AXES
    first, uv_step, (uv_w, uv_h) = (0, step, (full_w, full_h)) if uv_grid is None else uv_grid
    # trimesh's UV origin is the bottom-left (v up); its glTF export flips v to glTF's top-left origin.
    uv = np.stack([(first + cols * uv_step + 0.5) / uv_w, 1.0 - (first + rows * uv_step + 0.5) / uv_h], axis=1)
    grid, kept = index, keep
    if wrap_columns:  # the column after the last is the first, as copies one texture width to the right
        seam = index[:, 0][keep[:, 0]]
        wrap = np.full((h, 1), -1, dtype=np.int32)
        wrap[keep[:, 0], 0] = np.arange(count, count + len(seam), dtype=np.int32)
        grid, kept = np.concatenate([index, wrap], axis=1), np.concatenate([keep, keep[:, :1]], axis=1)
        vertices = np.concatenate([vertices, vertices[seam]])
        normals = None if normals is None else np.concatenate([normals, normals[seam]])
        uv = np.concatenate([uv, uv[seam] + np.array([1.0, 0.0])])
    tl, tr, bl, br = grid[:-1, :-1], grid[:-1, 1:], grid[1:, :-1], grid[1:, 1:]
    k_tl, k_tr, k_bl, k_br = kept[:-1, :-1], kept[:-1, 1:], kept[1:, :-1], kept[1:, 1:]
    upper, lower = k_tl & k_bl & k_tr, k_tr & k_bl & k_br
    faces = np.concatenate(
        [np.stack([tl[upper], bl[upper], tr[upper]], 1), np.stack([tr[lower], bl[lower], br[lower]], 1)]
    )
    material = trimesh.visual.material.PBRMaterial(
        baseColorTexture=Image.fromarray(rgb), metallicFactor=0.0, roughnessFactor=1.0, doubleSided=True
    )
    return trimesh.Trimesh(
        vertices=vertices,
        faces=faces,
        vertex_normals=normals,
        visual=trimesh.visual.TextureVisuals(uv=uv, material=material),
        process=False,
        validate=False,
    )


def mesh_step_for(height: int, width: int, step: int = DEFAULT_MESH_STEP, max_faces: Optional[int] = None) -> int:
    """The grid step of the mesh of a (height, width) output: `step`, made coarser until the grid's most faces
    (two per cell: 2 (ceil(h/step) - 1) (ceil(w/step) - 1)) are at most `max_faces` (None: `step` as it is)."""
    if max_faces is None:
        return step
    if isinstance(max_faces, bool) or not isinstance(max_faces, int) or max_faces < 2:
        raise ValueError(f"mesh_faces must be an int >= 2 or None, got {max_faces!r}")

    def faces(s: int) -> int:
        return 2 * max(0, -(-height // s) - 1) * max(0, -(-width // s) - 1)

    while faces(step) > max_faces:
        step += 1
    return step


# ------------------------------------------------------------------------------------------ summary
def to_json(record: dict) -> str:
    """Indented JSON with each list of numbers on one line (a 3x3 matrix reads as three rows)."""
    text = json.dumps(record, indent=2, default=str)
    return re.sub(r"\[\s+([-+0-9.eE,\s]+?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text) + "\n"


def check_formats(formats: Iterable[str]) -> tuple:
    """The format groups asked for, without duplicates, in the order given; a ValueError for unknown ones."""
    formats = tuple(dict.fromkeys(formats))
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"formats: unknown {unknown}; expected any of {tuple(FORMATS)}")
    return formats


def missing_format_library(formats: Iterable[str]) -> Optional[str]:
    """None when every library the formats need imports, else one line naming the package to install."""
    import importlib

    for fmt in formats:
        if fmt in _LIBRARIES:
            module, package = _LIBRARIES[fmt]
            try:
                importlib.import_module(module)
            except ImportError:
                return f"--{fmt} needs the {package} package: pip install {package}"
    return None


def write_text_atomic(path: Union[str, os.PathLike], text: str) -> None:
    """Write `text` to a temporary file beside `path` and rename it into place: `path` is either its old
    content or the whole new one, never a partial file (a full disk, a killed process)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise


def write_outputs(
    output: MoGeOutput,
    image_rgb: np.ndarray,
    out_dir: Union[str, os.PathLike],
    formats: Iterable[str] = DEFAULT_FORMATS,
    *,
    source: Optional[str] = None,
    extra: Optional[dict] = None,
    mesh_step: int = DEFAULT_MESH_STEP,
    mesh_faces: Optional[int] = None,
    root: Optional[Union[str, os.PathLike]] = None,
) -> dict:
    """Write one image's files into `out_dir` (created if needed) and return the result.json record.

    output: the MoGeOutput of the image (or a PanoramaOutput: depth is then its distance map, there is no
    normal.png, and the mesh closes at the seam); image_rgb: that image, (H, W, 3) uint8 (or float in [0, 1]) RGB
    at the output's size; formats: any of FORMATS (result.json is always written, last); mesh_step: the grid step
    of mesh.glb (1: every pixel), made coarser where the mesh would have more than `mesh_faces` faces
    (`mesh_step_for`; None: no bound; result.json's mesh_step is the step used). `source` (the input's name)
    and `extra` (more keys) go into result.json. `root`: the run's output folder; `out_dir` must lie inside it
    (a ValueError otherwise, before anything is written). Existing files of the same names are replaced.

    A folder holds a complete result exactly when it has result.json: an earlier result.json is removed before
    anything is written, and if writing fails (a full disk, a killed writer's exception), the files and folders
    this call created are removed again before the error is raised; nothing else is touched.
    """
    formats = check_formats(formats)
    if isinstance(mesh_step, bool) or not isinstance(mesh_step, int) or mesh_step < 1:
        raise ValueError(f"mesh_step must be a positive int, got {mesh_step!r}")
    rgb = _as_uint8_rgb(image_rgb, output)
    mesh_step = mesh_step_for(*output.depth.shape, mesh_step, mesh_faces)
    out = Path(out_dir)
    if root is not None and not inside(out, root):
        raise ValueError(f"out_dir {os.fspath(out)!r} is not inside the output folder {os.fspath(root)!r}")
    created = [p for p in (out, *out.parents) if not p.exists()]  # the folders this call makes, deepest first
    out.mkdir(parents=True, exist_ok=True)
    try:
        (out / RESULT_FILE).unlink()
    except FileNotFoundError:
        pass
    written: list = []
    try:
        return _write_files(output, rgb, out, formats, source, extra, mesh_step, written)
    except BaseException:
        for path in written:
            with contextlib.suppress(OSError):
                path.unlink()
        for folder in created:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty
        raise


def remove_outputs(out_dir: Union[str, os.PathLike], root: Union[str, os.PathLike]) -> bool:
    """Remove the files `write_outputs` writes in `out_dir` (`FILES`, result.json, its temporary files), then the
    folder and its parents up to `root` that are left empty. Anything else stays, and so does the folder holding
    it. Nothing happens outside `root`. Returns True when `out_dir` is gone."""
    out = Path(out_dir)
    if not out.is_dir() or not inside(out, root) or inside(root, out):
        return False
    ours = {name for names in FILES.values() for name in names} | {RESULT_FILE}
    for path in out.iterdir():
        temporary = path.name.startswith(f".{RESULT_FILE}.") and path.name.endswith(".tmp")  # write_text_atomic's
        if (path.name in ours or temporary) and path.is_file():
            with contextlib.suppress(OSError):
                path.unlink()
    remove_empty_folders(out, root)
    return not out.exists()


def remove_incomplete(out_dir: Union[str, os.PathLike], root: Union[str, os.PathLike]) -> bool:
    """`remove_outputs` of a folder without result.json: what an unfinished `write_outputs` left (a writer stopped
    with its process). A folder with result.json is complete and stays. Returns True when `out_dir` is gone."""
    if (Path(out_dir) / RESULT_FILE).exists():
        return False
    return remove_outputs(out_dir, root)


def remove_empty_folders(folder: Union[str, os.PathLike], root: Union[str, os.PathLike]) -> None:
    """Remove `folder` and then each parent below `root`, as long as they are empty (never `root` itself)."""
    top = os.path.realpath(root)
    for path in (Path(folder), *Path(folder).parents):
        if os.path.realpath(path) == top or not inside(path, root):
            break
        try:
            path.rmdir()  # only when empty
        except OSError:
            break


def _write_files(
    output: MoGeOutput,
    rgb: np.ndarray,
    out: Path,
    formats: tuple,
    source: Optional[str],
    extra: Optional[dict],
    mesh_step: int,
    created: list,
) -> dict:
    """The files of write_outputs; each file's path goes into `created` before it is written (so that a failed
    call removes its partial file too)."""
    record: dict = {"source": source, **output.summary(depth_percentiles=True)}
    written: list = []

    def target(name: str) -> Path:
        created.append(out / name)
        written.append(name)
        return out / name

    if "maps" in formats:
        known = (record["depth_p1_m"], record["depth_p99_m"])  # summary() took them from the same pixels
        depth_picture, (near, far) = colorize_depth(output.depth, output.mask, None if None in known else known)
        _write_png(target("depth.png"), depth_picture)
        record["depth_png_range_m"] = [finite_or_none(near), finite_or_none(far)]
        if output.normal is not None:
            _write_png(target("normal.png"), colorize_normal(output.normal, output.mask))
        _write_png(target("mask.png"), output.mask.astype(np.uint8) * 255)
        write_depth_exr(target("depth.exr"), output.depth)
    if "npz" in formats:
        output.save_npz(target("result.npz"), compress=True)  # a file to keep: its maps deflated
    if "ply" in formats or "glb" in formats:
        keep = kept_pixels(output)
        record["edge_rtol"] = DEPTH_EDGE_RTOL
        record["vertices"] = int(keep.sum())
        if not keep.any():  # nothing to export (e.g. all sky); the files list says what exists
            record["note"] = "no valid pixel off depth edges: points.ply and mesh.glb not written"
        else:
            if "ply" in formats:
                cloud = point_cloud(output, rgb, keep)
                ply = cloud.export(file_type="ply", vertex_normal=output.normal is not None)
                target("points.ply").write_bytes(ply)
            if "glb" in formats:
                mesh = image_mesh(
                    output,
                    rgb,
                    keep if mesh_step == 1 else None,
                    step=mesh_step,
                    wrap_columns=getattr(output, "is_panorama", False),
                )
                record.update(
                    mesh_step=mesh_step, mesh_vertices=int(len(mesh.vertices)), mesh_faces=int(len(mesh.faces))
                )
                if len(mesh.faces):
                    glb = mesh.export(file_type="glb")
                    target("mesh.glb").write_bytes(glb)
                else:  # a tiny photo, or one all on depth edges: trimesh cannot write a mesh without faces
                    record["note"] = f"no triangle on the grid of mesh_step {mesh_step}: mesh.glb not written"
    record["files"] = [*written, RESULT_FILE]
    record.update(extra or {})
    write_text_atomic(out / RESULT_FILE, to_json(record))
    return record
