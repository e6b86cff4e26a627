"""Find and read MoGe-2 checkpoints: a Hugging Face repo id, a directory holding `model.pt`, or `model.pt` itself.

A MoGe-2 `model.pt` is `{"model_config": {...}, "model": state_dict}`. We read it with `weights_only=True`
and load the state dict strictly: a config that does not match its weights is an error that names the
keys, never a silently half-loaded network (upstream loads with `strict=False`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

from . import env as environment
from .network.config import ConfigError, MoGe2Config

if TYPE_CHECKING:  # annotations only
    from .network import MoGe2Network

DEFAULT_REPO = "Ruicheng/moge-2-vitl-normal"
# The Hub revision of Ruicheng/moge-2-vitl-normal that the published numbers use (pass revision=None for main).
DEFAULT_REVISION = "b135031bae30b5ac2ae141a0e68717795ce38340"
WEIGHTS_DIR_ENV = "MOGE_WEIGHTS_DIR"
CHECKPOINT_NAME = "model.pt"

__all__ = [
    "DEFAULT_REPO",
    "DEFAULT_REVISION",
    "WEIGHTS_DIR_ENV",
    "CheckpointError",
    "Checkpoint",
    "resolve_checkpoint",
    "read_checkpoint",
    "build_network",
    "load_network",
    "ways_out",
    "describe_source",
    "RANDOM_WEIGHTS_DIR",
    "RANDOM_WEIGHTS_ONE_LINER",
]


class CheckpointError(ValueError):
    """The weights could not be found, read, or matched to their config."""


@dataclass
class Checkpoint:
    path: Path
    source: str  # what the user asked for: repo id (+ revision), directory or file
    revision: Optional[str]


def _looks_like_path(name: str) -> bool:
    # A Hub repo id is exactly "owner/name"; anything else that does not exist is a missing local path.
    return name.startswith(("/", ".", "~")) or name.endswith(".pt") or name.count("/") != 1 or "\\" in name


def _file_in(path: Path) -> Path:
    if path.is_dir():
        candidate = path / CHECKPOINT_NAME
        if not candidate.is_file():
            raise CheckpointError(
                f"{path} is a directory without {CHECKPOINT_NAME}; put "
                f"the MoGe-2 {CHECKPOINT_NAME} there or pass its path"
            )
        return candidate
    return path


def resolve_checkpoint(
    name_or_path: Union[str, os.PathLike] = DEFAULT_REPO, revision: Optional[str] = DEFAULT_REVISION
) -> tuple[Path, str, Optional[str]]:
    """Return (local path of model.pt, description of the source, revision used or None for local files).

    Order: an existing local file or directory; else `$MOGE_WEIGHTS_DIR` (which overrides a repo id, never a
    local path: a mistyped path is an error, not other weights); else the Hugging Face hub (its cache first, so
    a cached revision works offline).
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"pretrained_model_name_or_path must be a str or path, got {type(name_or_path).__name__}")
    name = os.fspath(name_or_path)
    local = Path(name).expanduser()
    if local.exists():
        return _file_in(local), str(local), None
    if isinstance(name_or_path, os.PathLike) or _looks_like_path(name):
        raise CheckpointError(
            f"weights not found: {name} does not exist (expected a Hugging Face repo id like "
            f"{DEFAULT_REPO!r}, a directory holding {CHECKPOINT_NAME}, or the path of {CHECKPOINT_NAME})"
        )
    env = environment.get(WEIGHTS_DIR_ENV)
    if env:
        env_path = Path(env).expanduser()
        if not env_path.exists():
            raise CheckpointError(
                f"${WEIGHTS_DIR_ENV}={env} does not exist; point it at "
                f"a directory holding {CHECKPOINT_NAME} or unset it"
            )
        return _file_in(env_path), f"${WEIGHTS_DIR_ENV}={env}", None
    return _download(name, revision), f"{name}@{revision or 'main'}", revision


def describe_source(
    name_or_path: Union[str, os.PathLike] = DEFAULT_REPO, revision: Optional[str] = DEFAULT_REVISION
) -> str:
    """Where `resolve_checkpoint` will take the weights from, in its words, without reading a file or asking the
    Hub: for log lines written before the weights load (`$MOGE_WEIGHTS_DIR` replaces a repo id)."""
    name = os.fspath(name_or_path)
    if Path(name).expanduser().exists() or _looks_like_path(name):
        return name
    env = environment.get(WEIGHTS_DIR_ENV)
    if env:
        return f"${WEIGHTS_DIR_ENV}={env}"
    return f"{name}@{revision or 'main'}"


# A random-weight checkpoint of the real format: the third way out when the real weights cannot be had.
RANDOM_WEIGHTS_DIR = "/tmp/moge-tiny"
RANDOM_WEIGHTS_ONE_LINER = (
    f'python -c "from tt_moge.random_weights import make_checkpoint; '
    f"make_checkpoint('{RANDOM_WEIGHTS_DIR}', 'tiny-vits-normal')\""
)
_COMMIT_HASH = re.compile(r"[0-9a-f]{40}")


def _hub_command() -> str:
    """The download command of the installed huggingface_hub: `hf` (0.34 and later) or `huggingface-cli`."""
    import huggingface_hub

    try:
        major, minor = (int(part) for part in huggingface_hub.__version__.split(".")[:2])
    except ValueError:
        return "hf"
    return "hf" if (major, minor) >= (0, 34) else "huggingface-cli"


def ways_out(repo_id: str = DEFAULT_REPO, revision: Optional[str] = DEFAULT_REVISION) -> str:
    """The three ways to weights when the Hub cannot supply them, one numbered line each (for messages)."""
    pin = f" --revision {revision}" if revision else ""
    return (
        f"  1. download it where there is network: {_hub_command()} download {repo_id} {CHECKPOINT_NAME}{pin}\n"
        f"  2. use a {CHECKPOINT_NAME} you have: {WEIGHTS_DIR_ENV}=/dir/with/{CHECKPOINT_NAME}, or pass the folder or "
        f"file (--weights PATH, from_pretrained(PATH))\n"
        f"  3. try it on random weights (meaningless outputs): {RANDOM_WEIGHTS_ONE_LINER}, "
        f"then {WEIGHTS_DIR_ENV}={RANDOM_WEIGHTS_DIR}"
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _unavailable(repo_id: str, revision: Optional[str], reason: str) -> CheckpointError:
    return CheckpointError(
        f"could not get {CHECKPOINT_NAME} of {repo_id} (revision {revision or 'main'}): {reason}, and "
        f"the local Hugging Face cache does not have it. Three ways out:\n" + ways_out(repo_id, revision)
    )


def _download(repo_id: str, revision: Optional[str]) -> Path:
    """model.pt of a Hub repo: from the Hugging Face cache, else downloaded. When the Hub cannot be reached, one
    request without retries decides it (the hub client would first retry with back-off);
    with HF_HUB_OFFLINE set, only the cache is read. A branch falls back to its cached copy, as the client does."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url

    def get(**kwargs) -> Path:
        return Path(
            hf_hub_download(repo_id=repo_id, filename=CHECKPOINT_NAME, revision=revision, repo_type="model", **kwargs)
        )

    def cached() -> Optional[Path]:
        try:
            return get(local_files_only=True)
        except Exception:  # not in the cache (the hub client raises several kinds)
            return None

    pinned = revision is not None and _COMMIT_HASH.fullmatch(revision) is not None
    if pinned or constants.HF_HUB_OFFLINE:
        path = cached()  # a pinned revision never changes: no request when the cache has it
        if path is not None:
            return path
        if constants.HF_HUB_OFFLINE:
            raise _unavailable(repo_id, revision, "HF_HUB_OFFLINE is set")
    try:  # the hub client's own metadata request, once: its default is no retry
        get_hf_file_metadata(
            hf_hub_url(repo_id, CHECKPOINT_NAME, revision=revision), timeout=constants.HF_HUB_ETAG_TIMEOUT
        )
    except Exception as exc:  # network errors, timeouts, HTTP errors (missing repo or revision, gated, auth)
        path = None if pinned else cached()
        if path is not None:
            return path
        response = getattr(exc, "response", None)
        status = getattr(response, "status_code", None)
        reason = (
            f"the Hub answered HTTP {status} ({_first_line(exc)})"
            if status is not None
            else f"the Hugging Face Hub cannot be reached ({_first_line(exc)})"
        )
        raise _unavailable(repo_id, revision, reason) from None
    try:
        return get()
    except Exception as exc:  # the download itself failed (the client retries network errors on its own)
        raise _unavailable(repo_id, revision, f"the download failed ({_first_line(exc)})") from None


def read_checkpoint(path: Union[str, os.PathLike]) -> tuple[dict, dict]:
    """Read (model_config, state_dict) from a MoGe-2 model.pt with `weights_only=True`."""
    import torch  # here: the option definitions import this module's constants without torch

    path = Path(path)
    size = path.stat().st_size
    try:
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            ckpt = torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) format
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{path} ({size} bytes) is not a readable MoGe-2 checkpoint: "
            f"torch.load failed ({type(exc).__name__}: {first}). "
            f"The file may be truncated or corrupt (an interrupted download?) or not a PyTorch file; download it again."
        ) from None
    if not isinstance(ckpt, dict) or "model_config" not in ckpt or "model" not in ckpt:
        keys = sorted(ckpt)[:8] if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(
            f"{path} is a PyTorch file but not a MoGe checkpoint: expected "
            f"a dict with 'model_config' and 'model', found {keys}"
        )
    if not isinstance(ckpt["model"], dict):
        raise CheckpointError(f"{path}: 'model' must be a state dict, found {type(ckpt['model']).__name__}")
    return ckpt["model_config"], ckpt["model"]


def _listing(keys: list, limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def build_network(config: dict, state_dict: dict, source: str = "checkpoint") -> MoGe2Network:
    """Build the network from its config and load the weights strictly, with a message a user can act on."""
    import torch

    from .network import MoGe2Network

    try:
        cfg = MoGe2Config.parse(config)
    except ConfigError as exc:
        raise CheckpointError(f"{source}: its model_config is not a MoGe-2 config we can build: {exc}") from None
    with torch.device("meta"):
        net = MoGe2Network(cfg)
    expected = {k: v.shape for k, v in net.state_dict().items()}
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    mismatched = sorted(
        f"{k} (checkpoint {tuple(state_dict[k].shape)}, config {tuple(expected[k])})"
        for k in set(expected) & set(state_dict)
        if tuple(state_dict[k].shape) != tuple(expected[k])
    )
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"missing from the weights: {_listing(missing)}")
        if unexpected:
            parts.append(f"in the weights but not in the network: {_listing(unexpected)}")
        if mismatched:
            parts.append(f"shape mismatches: {_listing(mismatched, 4)}")
        raise CheckpointError(
            f"{source}: the weights do not match the model_config ({cfg.describe()}): "
            + "; ".join(parts)
            + ". The config and the state dict come from different models, or the file was edited."
        )
    net.load_state_dict(state_dict, strict=True, assign=True)
    return net.float().eval().requires_grad_(False)  # checkpoints may be stored in half precision


def load_network(
    name_or_path: Union[str, os.PathLike] = DEFAULT_REPO, revision: Optional[str] = DEFAULT_REVISION
) -> tuple[MoGe2Network, Checkpoint]:
    """Resolve, read and build: the one call the model and the tools use."""
    path, source, rev = resolve_checkpoint(name_or_path, revision)
    config, state_dict = read_checkpoint(path)
    net = build_network(config, state_dict, source=str(path))
    return net, Checkpoint(path=path, source=source, revision=rev)
