"""Finding and reading checkpoints: every failure is one paragraph a user can act on."""

from __future__ import annotations

import pickle

import pytest
import torch

from tt_moge import weights
from tt_moge.testing import model_config
from tt_moge.weights import CheckpointError, load_network, read_checkpoint, resolve_checkpoint


def test_directory_file_and_env_resolution(checkpoint, monkeypatch):
    path = checkpoint("tiny-vits-normal")
    monkeypatch.delenv(weights.WEIGHTS_DIR_ENV, raising=False)
    assert resolve_checkpoint(path.parent)[0] == path  # a directory holding model.pt
    assert resolve_checkpoint(str(path))[0] == path  # model.pt itself
    # $MOGE_WEIGHTS_DIR overrides the (default) repo id, without touching the network
    monkeypatch.setenv(weights.WEIGHTS_DIR_ENV, str(path.parent))
    resolved, source, revision = resolve_checkpoint()
    assert resolved == path and weights.WEIGHTS_DIR_ENV in source and revision is None
    net, ckpt = load_network()
    assert ckpt.path == path and net.config.backbone_name == "dinov2_vits14"


def test_missing_local_path(tmp_path, monkeypatch):
    monkeypatch.delenv(weights.WEIGHTS_DIR_ENV, raising=False)
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nope" / "model.pt")
    with pytest.raises(CheckpointError, match="without model.pt"):
        resolve_checkpoint(tmp_path)
    monkeypatch.setenv(weights.WEIGHTS_DIR_ENV, str(tmp_path / "absent"))
    with pytest.raises(CheckpointError, match="MOGE_WEIGHTS_DIR"):
        resolve_checkpoint()


def test_weights_dir_env_never_replaces_a_mistyped_local_path(checkpoint, tmp_path, monkeypatch):
    """$MOGE_WEIGHTS_DIR replaces a repo id; a local path that does not exist stays an error (not other weights)."""
    monkeypatch.setenv(weights.WEIGHTS_DIR_ENV, str(checkpoint("tiny-vits-normal").parent))
    for missing in (tmp_path / "typo" / "model.pt", str(tmp_path / "typo"), "./typo/model.pt", "typo.pt"):
        with pytest.raises(CheckpointError, match="does not exist"):
            resolve_checkpoint(missing)
        assert weights.describe_source(missing) == str(missing)
    assert weights.WEIGHTS_DIR_ENV in resolve_checkpoint("someone/other-repo")[1]


def _use_hub_cache(monkeypatch, cache):
    # huggingface_hub reads its environment at import: point its constants at a private, offline cache
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def test_unreachable_hub_names_repo_and_how_to_supply_weights(tmp_path, monkeypatch):
    monkeypatch.delenv(weights.WEIGHTS_DIR_ENV, raising=False)
    _use_hub_cache(monkeypatch, tmp_path / "empty-hub-cache")
    with pytest.raises(CheckpointError) as info:
        resolve_checkpoint("Ruicheng/moge-2-vitl-normal")
    message = str(info.value)
    assert "Ruicheng/moge-2-vitl-normal" in message
    assert weights.DEFAULT_REVISION in message
    assert "MOGE_WEIGHTS_DIR" in message and "from_pretrained" in message


def test_hub_cache_is_used_offline(checkpoint, tmp_path, monkeypatch):
    """A revision already in the Hugging Face cache loads without network (the real hub code path)."""
    monkeypatch.delenv(weights.WEIGHTS_DIR_ENV, raising=False)
    cache = tmp_path / "hub"
    repo = cache / "models--someone--moge-2-test"
    rev = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    (snap / "model.pt").write_bytes(checkpoint("tiny-vits").read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    _use_hub_cache(monkeypatch, cache)
    path, source, revision = resolve_checkpoint("someone/moge-2-test", revision=rev)
    assert path.read_bytes()[:4] == b"PK\x03\x04" and revision == rev and rev in source
    path, _, _ = resolve_checkpoint("someone/moge-2-test", revision=None)  # None = the default branch
    assert path.is_file()


def test_truncated_file(checkpoint, tmp_path):
    data = checkpoint("tiny-vits").read_bytes()
    bad = tmp_path / "model.pt"
    bad.write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        read_checkpoint(bad)


@pytest.mark.parametrize("content", [b"", b"hello, not a checkpoint", b"\x89PNG\r\n\x1a\n" + bytes(100)])
def test_not_a_checkpoint(tmp_path, content):
    bad = tmp_path / "model.pt"
    bad.write_bytes(content)
    with pytest.raises(CheckpointError, match="not a readable MoGe-2 checkpoint"):
        read_checkpoint(bad)


def test_torch_file_of_something_else(tmp_path):
    other = tmp_path / "model.pt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, other)
    with pytest.raises(CheckpointError, match="not a MoGe checkpoint"):
        read_checkpoint(other)


class _Evil:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_weights_only_refuses_arbitrary_pickles(tmp_path, capsys):
    evil = tmp_path / "model.pt"
    with open(evil, "wb") as f:
        pickle.dump({"model_config": {}, "model": _Evil()}, f, protocol=2)
    with pytest.raises(CheckpointError):
        read_checkpoint(evil)
    assert "this must never run" not in capsys.readouterr().out


def test_wrong_config_names_the_keys(checkpoint, tmp_path):
    """A config that does not describe the weights fails (upstream's strict=False would load it silently)."""
    _, state = read_checkpoint(checkpoint("tiny-vits-normal"))
    wrong = model_config("tiny-vits-normal")
    wrong["encoder"]["backbone"] = "dinov2_vitb14"
    path = tmp_path / "model.pt"
    torch.save({"model_config": wrong, "model": state}, path)
    with pytest.raises(CheckpointError) as info:
        load_network(path)
    message = str(info.value)
    assert "shape mismatches" in message and "encoder.backbone.blocks.0.attn" in message
    assert "checkpoint (384" in message and "config (768" in message
    assert "dinov2_vitb14" in message

    no_normal = model_config("tiny-vits")  # weights have a normal head the config lacks
    torch.save({"model_config": no_normal, "model": state}, path)
    with pytest.raises(CheckpointError, match=r"in the weights but not in the network: normal_head\."):
        load_network(path)

    partial = dict(state)
    del partial["scale_head.0.weight"]
    torch.save({"model_config": model_config("tiny-vits-normal"), "model": partial}, path)
    with pytest.raises(CheckpointError, match=r"missing from the weights: scale_head\.0\.weight"):
        load_network(path)


def test_unbuildable_config(checkpoint, tmp_path):
    _, state = read_checkpoint(checkpoint("tiny-vits"))
    cfg = model_config("tiny-vits")
    cfg["encoder"]["backbone"] = "resnet50"
    path = tmp_path / "model.pt"
    torch.save({"model_config": cfg, "model": state}, path)
    with pytest.raises(CheckpointError, match="resnet50"):
        load_network(path)


def test_half_precision_checkpoint_loads_as_float32(checkpoint, tmp_path):
    config, state = read_checkpoint(checkpoint("tiny-vits"))
    path = tmp_path / "model.pt"
    torch.save({"model_config": config, "model": {k: v.half() for k, v in state.items()}}, path)
    net, _ = load_network(path)
    assert all(p.dtype == torch.float32 for p in net.parameters())
