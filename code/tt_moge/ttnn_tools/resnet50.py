"""tt-metal's Blackhole ResNet-50 (224x224, bfloat8_b activations and weights, LoFi), as ttnn calls: two blind
held-out points of the cost model (declared before their estimates: docs/tenstorrent.md, "The cost model").

Published figures. tt-metal's models/demos/vision/classification/resnet50/blackhole/tests/test_perf_device_resnet50.py
(newest stored version) expects `AVG DEVICE KERNEL SAMPLES/S` = 10610 at batch 16 and 15480 at batch 32 (margin
3 %): it profiles test_resnet50_performant.py::test_run_resnet50_inference with `skip_compile_run`, whose signposts
enclose one run of the model through tt_cnn's single-queue, untraced `ModelExecutor` (the input written from the host
straight into its L1 sharding, no device op; the model; the output read back), which is also the model's first run.
So 16 / 10610 = **1.508 ms** and 32 / 15480 = **2.067 ms of device kernel time per run**
(`PUBLISHED_KERNEL_MS`), dispatch and the gaps between ops not included. `ResNet50` issues the same ops with the same
configurations as that model (ttnn_resnet/tt/ttnn_functional_resnet50.py: `resnet50`, `resnet50Bottleneck`,
`ResnetLinear`; the input set-up of ttnn_resnet/tests/common/resnet50_test_infra.py), on a P150 (not a P100), written
here from a reading of that source (not copied; the weights are zeros).

The model: the input (N, 3, 224, 224) bfloat16, row-major, height-sharded in L1 (8x6 cores at batch 16, 13x10 at
32); `fold` (stride 2, as a transpose, padding 3 around the image and one channel: (N, 115, 115, 16)) onto a height
sharding of 128 cores; conv1 as a 4x4 / 1 conv 16 -> 64 on the folded image (the 7x7 / 2 stem folded), ReLU,
height-sharded with activation reuse; a 3x3 / 2 max pool to 56x56; the 16 bottlenecks (1x1 -> 3x3 -> 1x1 convs,
the first two with ReLU, the first block of each layer with a 1x1 downsample conv, the residual added in place with
a ReLU, the downsample moved onto the output's memory config when they differ): layer 1 at 56x56 and layer 2 at
28x28 height-sharded in their first block, layer 3 at 14x14 height-sharded with `reshard_if_not_optimal` in its
first, the others as the first leaves them; before layer 4 a move onto an 8x10 block sharding; layer 4 at 7x7
block-sharded; a move onto an 8x8 width sharding, the 7x7 average pool (bfloat8_b, tiles), a move onto an 8x4 width
sharding, the classifier (2048 -> 1000, weights bfloat16 in DRAM, a 1D multicast program config on 8x4 cores), an
untilize with the padding removed, a reshape. Every conv: weights bfloat8_b (given as host float32 with batch norm
folded, prepared by conv2d on its first call), bfloat8_b output, LoFi with packer L1 accumulation, the demo's
per-conv double buffering, `full_inner_dim`, activation reuse and act block heights (Blackhole, P150 values).

On the mock P150 (ttnn 0.81.1) the first run issues the same device ops as the second (conv2d prepares the weights on
the host), so the op list of the second is the one stored, like the others.

Simplified or changed: the fold's core grids follow the demo's formulas for batches 16 and 32 on the mock's 13x10
grid (the P150's). Nothing is read back or checked.

numpy and an injected ttnn only, like graph.py.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["ResNet50", "BATCHES", "PUBLISHED_SAMPLES_PER_S", "PUBLISHED_KERNEL_MS", "LAYERS"]

BATCHES = (16, 32)
PUBLISHED_SAMPLES_PER_S = {16: 10610.0, 32: 15480.0}  # test_perf_device_resnet50.py (Blackhole)
PUBLISHED_KERNEL_MS = {b: b / s * 1e3 for b, s in PUBLISHED_SAMPLES_PER_S.items()}  # 1.508 and 2.067 ms
IMAGE, STEM_K, STEM_S = 224, 3, 2  # the fold's padding (the stem's kernel_size argument) and stride
FOLDED = (IMAGE + 2 * STEM_K) // STEM_S  # 115
CONV1_OUT = FOLDED - 4 + 1  # 112: conv1 is 4x4 / 1 on the folded image
LAYERS = ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2))  # planes, blocks, stride of the first


def _nearest_32(x: int) -> int:
    return -(-x // 32) * 32


class ResNet50:
    """The demo's ResNet-50 at `batch` (16 or 32) on a P150 `device`; the constructor uploads the (zero) weights."""

    def __init__(self, ttnn, device, batch: int):
        if batch not in BATCHES:
            raise ValueError(f"batch: expected one of {BATCHES}, got {batch!r}")
        T = self.ttnn = ttnn
        self.device = device
        self.batch = batch
        self.weights = {}

        def host(shape):
            return T.Tensor(np.zeros(shape, np.float32), T.float32, None, T.ROW_MAJOR_LAYOUT)

        def conv_weights(name, c_in, c_out, k):
            self.weights[name] = (host((c_out, c_in, k, k)), host((1, 1, 1, c_out)))

        conv_weights("conv1", 16, 64, 4)  # the stem's 7x7 / 2 weights padded and folded for the unit stride
        self.blocks = []
        inplanes = 64
        for layer, (planes, count, stride) in enumerate(LAYERS, start=1):
            for i in range(count):
                name = f"layer{layer}_module{i + 1}"
                down = i == 0  # stride 2, or 64 -> 256 channels in layer 1
                s = stride if i == 0 else 1
                conv_weights(f"{name}.conv1", inplanes, planes, 1)
                conv_weights(f"{name}.conv2", planes, planes, 3)
                conv_weights(f"{name}.conv3", planes, planes * 4, 1)
                if down:
                    conv_weights(f"{name}.downsample", inplanes, planes * 4, 1)
                self.blocks.append((name, inplanes, planes, s, down))
                inplanes = planes * 4

        def on_device(shape):
            x = T.Tensor(np.zeros(shape, np.float32), T.bfloat16, None, T.TILE_LAYOUT)
            return T.to_device(x, device, memory_config=T.DRAM_MEMORY_CONFIG)

        self.fc = (on_device((1, 1, 2048, 1000)), on_device((1, 1, 1, 1000)))
        self.fc_config = T.MatmulMultiCoreReuseMultiCast1DProgramConfig(
            compute_with_storage_grid_size=(8, 4),
            in0_block_w=2,
            out_subblock_h=1,
            out_subblock_w=1,
            per_core_M=1,
            per_core_N=1,
            fuse_batch=True,
            fused_activation=None,
            mcast_in0=True,
        )
        self.fc_compute = T.init_device_compute_kernel_config(
            device.arch(),
            math_fidelity=T.MathFidelity.LoFi,
            math_approx_mode=True,
            fp32_dest_acc_en=False,
            packer_l1_acc=True,
        )
        self.conv_compute = T.init_device_compute_kernel_config(
            device.arch(), math_fidelity=T.MathFidelity.LoFi, packer_l1_acc=True
        )
        self.conv1_config = T.Conv2dConfig(
            weights_dtype=T.bfloat8_b,
            activation=T.UnaryWithParam(T.UnaryOpType.RELU),
            deallocate_activation=True,
            act_block_h_override=49 * 32 if batch == 32 else 0,
            enable_act_double_buffer=True,
            shard_layout=T.TensorMemoryLayout.HEIGHT_SHARDED,
            reshard_if_not_optimal=False,
            enable_activation_reuse=True,
        )
        # the fold: its compute grid, and the height sharding of its output (the largest core count up to the grid's
        # that divides conv1's output tiles, as the demo computes it on Blackhole)
        if batch == 16:
            self.fold_grid = T.CoreRangeSet({T.CoreRange(T.CoreCoord(0, 0), T.CoreCoord(7, 7))})
        else:
            self.fold_grid = T.CoreRangeSet(
                {
                    T.CoreRange(T.CoreCoord(0, 0), T.CoreCoord(12, 8)),
                    T.CoreRange(T.CoreCoord(0, 9), T.CoreCoord(10, 9)),
                }
            )
        grid = device.compute_with_storage_grid_size()
        tiles = math.ceil(batch * CONV1_OUT * CONV1_OUT / 32)
        cores = grid.x * grid.y
        while tiles % cores:
            cores -= 1
        fold_cores = T.num_cores_to_corerangeset(cores, grid, row_wise=True)
        self.fold_memory = T.create_sharded_memory_config(
            shape=(1, 1, math.ceil(FOLDED * FOLDED * batch / cores), 16),
            core_grid=fold_cores,
            strategy=T.ShardStrategy.HEIGHT,
            orientation=T.ShardOrientation.ROW_MAJOR,
            use_height_and_width_as_shard_shape=True,
        )
        # the test's input sharding (resnet50_test_infra.setup_l1_sharded_input)
        gx, gy = (6, 8) if batch == 16 else (13, 10)
        shard_h = -(-(batch * 3 * IMAGE) // (gx * gy))
        self.input_memory = T.MemoryConfig(
            T.TensorMemoryLayout.HEIGHT_SHARDED,
            T.BufferType.L1,
            T.ShardSpec(
                T.CoreRangeSet({T.CoreRange(T.CoreCoord(0, 0), T.CoreCoord(gx - 1, gy - 1))}),
                (shard_h, IMAGE),
                T.ShardOrientation.ROW_MAJOR,
            ),
        )

    def input(self):
        """The test's input: (N, 3, 224, 224) bfloat16, row-major, height-sharded in L1, written from the host."""
        T = self.ttnn
        x = T.Tensor(np.zeros((self.batch, 3, IMAGE, IMAGE), np.float32), T.bfloat16, None, T.ROW_MAJOR_LAYOUT)
        return T.to_device(x, self.device, memory_config=self.input_memory)

    # ------------------------------------------------------------------------------------------- the ops
    def conv(self, x, name, c_in, c_out, h, w, k, stride, config, dims=True):
        T = self.ttnn
        weight, bias = self.weights[name]
        pad = 1 if k == 3 else 0
        out = T.conv2d(
            input_tensor=x,
            weight_tensor=weight,
            bias_tensor=bias,
            in_channels=c_in,
            out_channels=c_out,
            batch_size=self.batch,
            input_height=h,
            input_width=w,
            kernel_size=(k, k),
            stride=(stride, stride),
            padding=(pad, pad),
            dilation=(1, 1),
            groups=1,
            device=self.device,
            conv_config=config,
            compute_config=self.conv_compute,
            return_output_dim=True,
            return_weights_and_bias=True,
            dtype=T.bfloat8_b,
        )
        y, (oh, ow), (weight, bias) = out
        self.weights[name] = (weight, bias)  # prepared on the first call, reused after
        return y, oh, ow

    def bottleneck(self, x, block, h, w, reshard=False, height=None):
        """`resnet50Bottleneck.__call__`: `height` is the demo's `height_sharding` (None in the calls that leave it
        out, which select block sharding)."""
        T = self.ttnn
        name, c_in, planes, stride, down = block
        layout = T.TensorMemoryLayout.HEIGHT_SHARDED if height else T.TensorMemoryLayout.BLOCK_SHARDED
        relu = T.UnaryWithParam(T.UnaryOpType.RELU)
        cfg1 = T.Conv2dConfig(
            weights_dtype=T.bfloat8_b, activation=relu, shard_layout=layout, reshard_if_not_optimal=reshard
        )
        y, oh, ow = self.conv(x, f"{name}.conv1", c_in, planes, h, w, 1, 1, cfg1)
        cfg2 = T.Conv2dConfig(
            weights_dtype=T.bfloat8_b,
            activation=relu,
            deallocate_activation=True,
            reallocate_halo_output=False,
            act_block_h_override=16 * 32 if name == "layer1_module3" else 0,
            shard_layout=layout,
            reshard_if_not_optimal=reshard,
            enable_act_double_buffer=True,
            enable_weights_double_buffer=True,
            full_inner_dim=True,
            enable_activation_reuse=bool(height) and stride == 1,
        )
        y, oh, ow = self.conv(y, f"{name}.conv2", planes, planes, oh, ow, 3, stride, cfg2)
        cfg3 = T.Conv2dConfig(
            weights_dtype=T.bfloat8_b, shard_layout=layout, reshard_if_not_optimal=reshard, deallocate_activation=True
        )
        y, _, _ = self.conv(y, f"{name}.conv3", planes, planes * 4, oh, ow, 1, 1, cfg3)
        identity = x
        if down:
            ds_layout = (
                T.TensorMemoryLayout.HEIGHT_SHARDED if height and h != 28 else T.TensorMemoryLayout.BLOCK_SHARDED
            )
            cfg = T.Conv2dConfig(
                weights_dtype=T.bfloat8_b,
                shard_layout=ds_layout,
                deallocate_activation=True,
                reallocate_halo_output=False,
                reshard_if_not_optimal=reshard,
                enable_act_double_buffer=True,
                enable_weights_double_buffer=w < 56,
                full_inner_dim=True,
                enable_activation_reuse=bool(height) and stride == 1,
            )
            identity, _, _ = self.conv(x, f"{name}.downsample", c_in, planes * 4, h, w, 1, stride, cfg)
        if identity.memory_config() != y.memory_config():
            identity = T.to_memory_config(identity, y.memory_config())
        y = T.add_(y, identity, activations=[T.UnaryWithParam(T.UnaryOpType.RELU)])
        T.deallocate(identity)
        return y, oh, ow

    def _sharded(self, shape, grid, layout):
        T = self.ttnn
        return T.create_sharded_memory_config_(
            shape,
            T.CoreGrid(x=grid[0], y=grid[1]),
            layout,
            T.ShardOrientation.ROW_MAJOR,
            tile_layout=True,
            use_height_and_width_as_shard_shape=True,
        )

    def __call__(self, x):
        T = self.ttnn
        n = self.batch
        y = T.fold(
            x,
            STEM_S,
            STEM_S,
            use_transpose_as_fold=True,
            padding=[STEM_K, STEM_K, STEM_K, STEM_K, 0, 1],
            grid_size=self.fold_grid,
            override_memory_config=self.fold_memory,
        )
        b, c, h, w = y.shape
        y = T.reshape(y, (1, 1, b * c * h, w))
        T.deallocate(x)
        y, [h, w], [wt, bs] = T.conv2d(
            input_tensor=y,
            weight_tensor=self.weights["conv1"][0],
            bias_tensor=self.weights["conv1"][1],
            in_channels=16,
            out_channels=64,
            batch_size=n,
            input_height=FOLDED,
            input_width=FOLDED,
            kernel_size=(4, 4),
            stride=(1, 1),
            padding=(0, 0),
            dilation=(1, 1),
            groups=1,
            device=self.device,
            conv_config=self.conv1_config,
            compute_config=self.conv_compute,
            return_output_dim=True,
            return_weights_and_bias=True,
            dtype=T.bfloat8_b,
        )
        self.weights["conv1"] = (wt, bs)
        y = T.max_pool2d(
            input_tensor=y,
            batch_size=n,
            input_h=h,
            input_w=w,
            channels=64,
            kernel_size=[3, 3],
            stride=[2, 2],
            padding=[1, 1],
            dilation=[1, 1],
        )
        h = w = 56
        # (reshard_if_not_optimal, height_sharding) of each layer's first block on Blackhole; the others pass neither
        first = {1: (True, True), 2: (False, True), 3: (True, True), 4: (False, False)}
        for block in self.blocks:
            layer = int(block[0][5])
            if block[0] == "layer4_module1":
                shape = [_nearest_32(y.shape[2] // 10), y.shape[3] // 8]
                y = T.to_memory_config(y, self._sharded(shape, (8, 10), T.TensorMemoryLayout.BLOCK_SHARDED))
            if block[0].endswith("module1"):
                reshard, height = first[layer]
                y, h, w = self.bottleneck(y, block, h, w, reshard=reshard, height=height)
            else:
                y, h, w = self.bottleneck(y, block, h, w)
        shape = [_nearest_32(y.shape[2]), y.shape[3] // 64]
        y = T.to_memory_config(y, self._sharded(shape, (8, 8), T.TensorMemoryLayout.WIDTH_SHARDED))
        y = T.avg_pool2d(
            input_tensor=y,
            batch_size=n,
            input_h=h,
            input_w=w,
            channels=y.shape[3],
            kernel_size=[h, w],
            stride=[1, 1],
            padding=[0, 0, 0, 0],
            output_layout=T.TILE_LAYOUT,
            dtype=T.bfloat8_b,
            compute_kernel_config=T.init_device_compute_kernel_config(
                self.device.arch(), math_fidelity=T.MathFidelity.LoFi
            ),
        )
        shape = [_nearest_32(y.shape[2]), y.shape[3] // 32]
        y = T.to_memory_config(y, self._sharded(shape, (8, 4), T.TensorMemoryLayout.WIDTH_SHARDED))
        weight, bias = self.fc
        y = T.linear(
            y,
            weight,
            bias=bias,
            program_config=self.fc_config,
            memory_config=T.L1_WIDTH_SHARDED_MEMORY_CONFIG,
            dtype=T.bfloat8_b,
            compute_kernel_config=self.fc_compute,
        )
        end = (y.shape[0] - 1, y.shape[1] - 1, y.shape[2] - 1, 1000 - 1)
        y = T.untilize_with_unpadding(y, output_tensor_end=end, memory_config=T.L1_MEMORY_CONFIG)
        return T.reshape(y, (n, y.shape[1], y.shape[2] // n, y.shape[3]))
