"""One fold (`runners/folding.py`): the CPU/CUDA graph (`FixedShapeMoGe2`), the ONNX export's module and the
Tenstorrent runner's `prepare_weights` each take their folded weights from one call of `folding.fold`, and
`prepare_weights` builds no torch module to get them (it used to build the whole CPU graph to read its
weights)."""

from __future__ import annotations

import pytest
import torch

from tt_moge.testing import make_network

SMALL, SMALL_TOKENS = (224, 126), 300


def test_prepare_weights_builds_no_torch_module(monkeypatch):
    from tt_moge.runners.ttnn.prepare import prepare_weights

    network = make_network("tiny-vits-normal")
    built = []
    init = torch.nn.Module.__init__

    def counted(self, *args, **kwargs):
        built.append(type(self).__name__)
        init(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__init__", counted)
    torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert built == ["Linear", "Sequential"]  # the counter sees modules being built
    built.clear()
    prepared = prepare_weights(network, SMALL, SMALL_TOKENS)
    monkeypatch.undo()
    assert built == []
    assert prepared.plan["blocks"] == 4 and len(prepared.arrays) > 20


def test_every_fast_path_takes_its_weights_from_one_fold(monkeypatch):
    from tt_moge.onnx_export import ExportGraph
    from tt_moge.runners import folding
    from tt_moge.runners.fixed_graph import FixedShapeMoGe2, finest_conv
    from tt_moge.runners.ttnn.prepare import prepare_weights

    network = make_network("tiny-vits-normal")
    calls, real = [], folding.fold

    def spy(*args):
        calls.append(args)
        folds = real(*args)
        results.append(folds)
        return folds

    results: list = []
    monkeypatch.setattr(folding, "fold", spy)
    graph = FixedShapeMoGe2(network, SMALL, SMALL_TOKENS, torch.float32, channels_last=False)
    prepared = prepare_weights(network, SMALL, SMALL_TOKENS)
    exported = ExportGraph(network, SMALL, SMALL_TOKENS).module.fixed
    assert [(args[0] is network, tuple(args[1]), args[2]) for args in calls] == [(True, SMALL, SMALL_TOKENS)] * 3
    folds = results[0]
    grid = folds.rows * folds.cols
    # what each consumer holds is the fold, laid out its own way
    for module in (graph, exported):
        assert torch.equal(_conv_weight(module.neck_finest), _conv_weight(finest_conv(folds.neck_up, folds.neck_fold)))
        assert torch.equal(module.finest_const, folds.finest_const)
        assert torch.equal(module.blocks[0].qkv.weight, folds.blocks[0].qkv[0])
    assert (prepared.arrays["finest.const"] == folds.finest_const[0].numpy()).all()
    assert (prepared.arrays["token_table"][grid:] == folds.token_prefix[0].numpy()).all()
    assert (prepared.arrays["blocks.0.qkv.w"] == folds.blocks[0].qkv[0].numpy().T).all()


def test_fold_leaves_the_network_alone_and_prepared_arrays_are_copies():
    from tt_moge.runners import folding
    from tt_moge.runners.ttnn.prepare import prepare_weights

    network = make_network("tiny-vits-normal")
    before = {k: v.clone() for k, v in network.state_dict().items()}
    folds = folding.fold(network, SMALL, SMALL_TOKENS)
    prepared = prepare_weights(network, SMALL, SMALL_TOKENS)
    assert all(torch.equal(v, before[k]) for k, v in network.state_dict().items())
    assert folds.num_levels == len(network.neck.res_blocks) and list(folds.heads) == ["points", "normal", "mask"]
    # arrays read from the network's own modules (norms, the coarse convs) do not share its memory
    weight = network.encoder.backbone.norm.weight
    with torch.no_grad():
        weight += 1
    assert not (prepared.arrays["final_norm.w"] == weight.detach().numpy()).any()


def test_each_part_prepared_alone_is_that_part_of_the_whole():
    """A part's weights prepared from its own modules (what the part tests build) are, key for key and bit for bit,
    those of the whole network prepared (what the runner uploads), and its plan's entries are within the whole
    plan's (a part's plan leaves the conv stacks' structure out): a part test checks the part the runner runs."""
    import numpy as np

    from tt_moge.runners.ttnn.prepare import prepare_encoder, prepare_finest, prepare_patch_embed, prepare_weights

    network = make_network("tiny-vits-normal")
    whole = prepare_weights(network, SMALL, SMALL_TOKENS)
    for make in (prepare_patch_embed, prepare_encoder, prepare_finest):
        part = make(network, SMALL, SMALL_TOKENS)
        assert part.arrays, make.__name__
        for key, array in part.arrays.items():
            assert key in whole.arrays, (make.__name__, key)
            assert array.dtype == whole.arrays[key].dtype and np.array_equal(array, whole.arrays[key]), key
        for key, value in part.plan.items():
            assert key in whole.plan and _within(value, whole.plan[key]), (make.__name__, key)


def _conv_weight(module: torch.nn.Module) -> torch.Tensor:
    """The weight of the one convolution in `module` (the finest level's conv, before or after its upsampling)."""
    (conv,) = [m for m in module.modules() if isinstance(m, torch.nn.Conv2d)]
    return conv.weight


def _within(part, whole) -> bool:
    """`part` equals `whole`, except that a dict of `part` may leave keys of `whole`'s out (recursively)."""
    if isinstance(part, dict):
        return isinstance(whole, dict) and all(k in whole and _within(v, whole[k]) for k, v in part.items())
    if isinstance(part, (list, tuple)):
        return len(part) == len(whole) and all(_within(a, b) for a, b in zip(part, whole))
    return part == whole


@pytest.mark.parametrize("size", [(1, 1), (2, 3), (7, 9)])
def test_the_finest_conv_runs_at_the_coarse_level_as_the_same_function(size):
    """conv3x3(replicate pad(bilinear 2x upsample(x))) == pixel shuffle(conv3x3(replicate pad(x)) with
    subpixel_kernel), to float64 round-off, edges included (the CPU graph's finest level runs the right side);
    other upsamplings are left as they are."""
    import torch.nn.functional as F

    from tt_moge.runners.fixed_graph import finest_conv, subpixel_kernel

    gen = torch.Generator().manual_seed(sum(size))
    w = torch.randn(5, 6, 3, 3, generator=gen, dtype=torch.float64)
    x = torch.randn(1, 6, *size, generator=gen, dtype=torch.float64)
    up = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
    ref = F.conv2d(F.pad(up, (1, 1, 1, 1), mode="replicate"), w)
    sub = F.pixel_shuffle(F.conv2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), subpixel_kernel(w)), 2)
    assert ref.shape == sub.shape == (1, 5, 2 * size[0], 2 * size[1])
    assert (sub - ref).abs().max() < 1e-12 * ref.abs().max()
    bilinear = finest_conv((torch.nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),), w.float())
    assert isinstance(bilinear[-1], torch.nn.PixelShuffle)
    assert torch.equal(_conv_weight(bilinear), subpixel_kernel(w.float()))
    nearest = finest_conv((torch.nn.Upsample(scale_factor=2, mode="nearest"),), w.float())
    assert isinstance(nearest[0], torch.nn.Upsample) and torch.equal(_conv_weight(nearest), w.float())
