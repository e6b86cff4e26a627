"""tt-metal's Blackhole VGG-UNet (a U-Net with a VGG19 encoder), as ttnn calls: a blind held-out point of the cost
model (declared before its estimate: docs/tenstorrent.md, "The cost model").

Published figure. tt-metal's models/demos/vision/segmentation/vgg_unet/blackhole/tests/perf/test_perf_vgg_unet.py
(newest stored version) expects `AVG DEVICE KERNEL SAMPLES/S` = 488 at batch 1 (margin 3 %): it profiles
tests/pcc/test_vgg_unet.py::test_vgg_unet, which runs the model once on a 1 x 3 x 256 x 256 input, so 1 / 488 =
**2.049 ms of device kernel time per call** (`PUBLISHED_KERNEL_MS`), dispatch and the gaps between ops not
included. `VggUnet` issues the same ops with the same configurations as that model (common/ttnn/ttnn_vgg_unet.py:
`Tt_vgg_unet`, `Conv`, `Conv_transpose`, `sharded_concat`; the per-layer choices of
common/ttnn/model_preprocessing.py: `create_vgg_unet_model_parameters`), written here from a reading of that source
(not copied; the weights are zeros).

The model: the input (bfloat16, row-major, channels first, in L1) padded to 16 channels, permuted to channels last
and flattened; the VGG19 encoder, 3x3 convs with ReLU and 2x2 max pools: 3 -> 64 -> 64 at 256x256, 128 x 2 at
128x128, 256 x 4 at 64x64 (after the first, a move onto an 8x8 block sharding of 512 x 32 shards), 512 x 4 at 32x32,
512 x 4 at 16x16; four decoder blocks, each a 2x2 / 2 transposed conv (bfloat16 out), a height-sharded channel
concat with the skip tensor on 8x8 cores (`sharded_concat`: both inputs moved onto that sharding first) and two 3x3
convs with ReLU (1024 -> 512 -> 512 at 32x32, 512 -> 256 -> 256 at 64x64, 256 -> 128 -> 128 at 128x128,
128 -> 64 -> 64 at 256x256), the output of the second and third blocks moved to L1 interleaved; a 1x1 conv 64 -> 1
and the accurate sigmoid on its height sharding. Every conv: weights bfloat8_b (given as host float32 with batch
norm folded, prepared by conv2d on its first call), output bfloat16, LoFi without fp32 accumulation or packer L1
accumulation, approximate math, double-buffered activations and weights, and the demo's per-layer sharding (height,
block or ttnn's choice), act block height, `reshard_if_not_optimal`, `deallocate_activation` and output layout
(`CONVS`).

On the mock P150 (ttnn 0.81.1) the model's first call, the one the test profiles, issues the same device ops as its
second (conv2d prepares the weights on the host), so the op list of the second is the one stored, like the others.

Simplified or changed: the demo's conv arguments come from `infer_ttnn_module_args` on the torch model and the
preprocessor's overrides; here they are written out (`CONVS`). The test's `from_torch(...).to(device,
L1_MEMORY_CONFIG)` is a host tensor and `to_device` here (the same write, no device op).

numpy and an injected ttnn only, like graph.py.
"""

from __future__ import annotations

import numpy as np

__all__ = ["VggUnet", "CONVS", "PUBLISHED_KERNEL_MS"]

SIZE = 256
MIN_CHANNELS = 16
PUBLISHED_KERNEL_MS = 1 / 488.0 * 1e3  # test_perf_vgg_unet.py, AVG DEVICE KERNEL SAMPLES/S 488: 2.049 ms per call
CONCAT_CORES = 64  # sharded_concat: height sharding on the 8x8 grid


def _conv(c_in, c_out, size, *, layout=None, block_h=None, reshard=False, tile=False, relu=True, dealloc=True, k=3):
    """layout: "height", "block" or None (ttnn's choice); tile: TILE output (else row-major)."""
    return dict(
        c_in=c_in,
        c_out=c_out,
        size=size,
        layout=layout,
        block_h=block_h,
        reshard=reshard,
        tile=tile,
        relu=relu,
        dealloc=dealloc,
        k=k,
    )


# name -> geometry (input height = width = size) and the demo's per-layer choices (model_preprocessing.py)
CONVS = {
    "s1_0": _conv(3, 64, 256, layout="height"),
    "s1_2": _conv(64, 64, 256, layout="height", block_h=16 * 32),
    "s2_5": _conv(64, 128, 128, layout="height"),
    "s2_7": _conv(128, 128, 128, layout="height"),
    "s3_10": _conv(128, 256, 64, layout="height"),
    "s3_12": _conv(256, 256, 64, tile=True),
    "s3_14": _conv(256, 256, 64, tile=True),
    "s3_16": _conv(256, 256, 64),
    "s4_19": _conv(256, 512, 32, tile=True),
    "s4_21": _conv(512, 512, 32, tile=True),
    "s4_23": _conv(512, 512, 32, tile=True),
    "s4_25": _conv(512, 512, 32),
    "b1_28": _conv(512, 512, 16, tile=True),
    "b1_30": _conv(512, 512, 16, tile=True),
    "b1_32": _conv(512, 512, 16, tile=True),
    "b1_34": _conv(512, 512, 16),
    "d1.up": _conv(512, 512, 16, dealloc=False, relu=False, k=2),
    "d1.conv1": _conv(1024, 512, 32, layout="block", reshard=True, tile=True),
    "d1.conv2": _conv(512, 512, 32, tile=True),
    "d2.up": _conv(512, 256, 32, relu=False, k=2),
    "d2.conv1": _conv(512, 256, 64, layout="block", reshard=True, tile=True),
    "d2.conv2": _conv(256, 256, 64, layout="block", tile=True),
    "d3.up": _conv(256, 128, 64, layout="height", block_h=32 * 4, relu=False, k=2),
    "d3.conv1": _conv(256, 128, 128, layout="height", block_h=32 * 2, tile=True),
    "d3.conv2": _conv(128, 128, 128, layout="height"),
    "d4.up": _conv(128, 64, 128, block_h=32 * 8, reshard=True, relu=False, k=2),
    "d4.conv1": _conv(128, 64, 256, layout="height", block_h=32 * 4, tile=True),
    "d4.conv2": _conv(64, 64, 256, layout="height", block_h=32 * 16, tile=True),
    "out": _conv(64, 1, 256, relu=False, k=1),
}
ENCODER = (
    ("s1_0", "s1_2"),
    ("s2_5", "s2_7"),
    ("s3_10", "s3_12", "s3_14", "s3_16"),
    ("s4_19", "s4_21", "s4_23", "s4_25"),
    ("b1_28", "b1_30", "b1_32", "b1_34"),
)
DECODER = ("d1", "d2", "d3", "d4")


class VggUnet:
    """The demo's VGG-UNet at batch 1 on `device`; the constructor uploads the (zero) weights."""

    def __init__(self, ttnn, device):
        T = self.ttnn = ttnn
        self.device = device
        layouts = {"height": T.TensorMemoryLayout.HEIGHT_SHARDED, "block": T.TensorMemoryLayout.BLOCK_SHARDED}
        self.weights, self.configs = {}, {}
        for name, c in CONVS.items():
            transposed = name.endswith(".up")
            shape = (c["c_in"], c["c_out"], c["k"], c["k"]) if transposed else (c["c_out"], c["c_in"], c["k"], c["k"])
            self.weights[name] = (
                T.Tensor(np.zeros(shape, np.float32), T.float32, None, T.ROW_MAJOR_LAYOUT),
                T.Tensor(np.zeros((1, 1, 1, c["c_out"]), np.float32), T.float32, None, T.ROW_MAJOR_LAYOUT),
            )
            cfg = T.Conv2dConfig(
                weights_dtype=T.bfloat8_b,
                shard_layout=layouts.get(c["layout"]),
                reshard_if_not_optimal=c["reshard"],
                deallocate_activation=c["dealloc"],
                enable_act_double_buffer=True,
                enable_weights_double_buffer=True,
                output_layout=T.TILE_LAYOUT if c["tile"] else T.ROW_MAJOR_LAYOUT,
            )
            if c["relu"]:
                cfg.activation = T.UnaryWithParam(T.UnaryOpType.RELU)
            if c["block_h"] is not None:
                cfg.act_block_h_override = c["block_h"]
            self.configs[name] = cfg
        self.compute = T.init_device_compute_kernel_config(
            device.arch(),
            math_fidelity=T.MathFidelity.LoFi,
            fp32_dest_acc_en=False,
            packer_l1_acc=False,
            math_approx_mode=True,
        )
        self.grid = T.CoreRangeSet({T.CoreRange(T.CoreCoord(0, 0), T.CoreCoord(7, 7))})

    def input(self):
        """The test's input: (1, 3, 256, 256) bfloat16, row-major, interleaved in L1."""
        T = self.ttnn
        x = T.Tensor(np.zeros((1, 3, SIZE, SIZE), np.float32), T.bfloat16, None, T.ROW_MAJOR_LAYOUT)
        return T.to_device(x, self.device, memory_config=T.L1_MEMORY_CONFIG)

    def conv(self, x, name):
        T = self.ttnn
        c = CONVS[name]
        weight, bias = self.weights[name]
        transposed = name.endswith(".up")
        pad = 0 if transposed or c["k"] == 1 else 1
        kwargs = dict(
            input_tensor=x,
            weight_tensor=weight,
            bias_tensor=bias,
            in_channels=c["c_in"],
            out_channels=c["c_out"],
            batch_size=1,
            input_height=c["size"],
            input_width=c["size"],
            kernel_size=(c["k"], c["k"]),
            stride=(2, 2) if transposed else (1, 1),
            padding=(pad, pad),
            dilation=(1, 1),
            groups=1,
            device=self.device,
            conv_config=self.configs[name],
            compute_config=self.compute,
            return_output_dim=True,
            return_weights_and_bias=True,
            dtype=T.bfloat16,
        )
        if transposed:
            y, _, [weight, bias] = T.conv_transpose2d(**kwargs, output_padding=(0, 0), mirror_kernel=True)
        else:
            y, _, [weight, bias] = T.conv2d(**kwargs)
        self.weights[name] = (weight, bias)  # prepared on the first call, reused after
        return y

    def pool(self, x, size):
        return self.ttnn.max_pool2d(
            input_tensor=x,
            batch_size=1,
            input_h=size,
            input_w=size,
            channels=x.shape[3],
            kernel_size=[2, 2],
            stride=[2, 2],
            padding=[0, 0],
            dilation=[1, 1],
        )

    def sharded_concat(self, tensors):
        """Both inputs moved onto a height sharding of the 8x8 grid, then concatenated along the channels there."""
        T = self.ttnn

        def mem(height, width):
            return T.create_sharded_memory_config(
                (height, width),
                core_grid=self.grid,
                strategy=T.ShardStrategy.HEIGHT,
                use_height_and_width_as_shard_shape=True,
            )

        shard_h = -(-tensors[0].shape[2] // CONCAT_CORES)
        moved = [T.to_memory_config(t, mem(shard_h, t.shape[-1])) for t in tensors]
        return T.concat(moved, 3, memory_config=mem(shard_h, sum(t.shape[-1] for t in tensors)))

    def __call__(self, x):
        T = self.ttnn
        p = T.pad(x, ((0, 0), (0, MIN_CHANNELS - 3), (0, 0), (0, 0)), value=0.0)
        T.deallocate(x)
        p = T.permute(p, (0, 2, 3, 1))
        y = T.reshape(p, (1, 1, SIZE * SIZE, MIN_CHANNELS))
        skips = []
        for i, names in enumerate(ENCODER):
            if i:
                y = self.pool(y, CONVS[ENCODER[i - 1][-1]]["size"])
            for name in names:
                y = self.conv(y, name)
                if name == "s3_10":
                    block = T.create_sharded_memory_config(
                        [512, 32],
                        core_grid=self.grid,
                        strategy=T.ShardStrategy.BLOCK,
                        use_height_and_width_as_shard_shape=True,
                    )
                    y = T.to_memory_config(y, block)
            skips.append(y)
        skips.pop()  # the bridge's output is the decoder's input, not a skip
        for i, d in enumerate(DECODER):
            if i >= 2:
                y = T.sharded_to_interleaved(y, T.L1_MEMORY_CONFIG)
            skip = skips.pop()
            y = self.conv(y, f"{d}.up")
            y = self.sharded_concat([y, skip])
            y = self.conv(y, f"{d}.conv1")
            y = self.conv(y, f"{d}.conv2")
            T.deallocate(skip)
        y = self.conv(y, "out")
        spec = y.memory_config().shard_spec
        out_mem = T.create_sharded_memory_config(
            [spec.shape[0], spec.shape[1]],
            core_grid=spec.grid,
            strategy=T.ShardStrategy.HEIGHT,
            use_height_and_width_as_shard_shape=True,
        )
        return T.sigmoid_accurate(y, memory_config=out_mem)
