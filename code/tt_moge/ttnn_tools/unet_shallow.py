"""tt-metal's UNet shallow on Blackhole, as ttnn calls: the cost model's calibration case for convolutions.

The ViTs (`hires_vit.py`, `vit_base.py`) have matmuls, SDPA, softmax and layer norms but no convs, halos, pools
or upsamples. tt-metal's UNet shallow (models/experimental/functional_unet: tt/unet_shallow_ttnn.py,
tt/model_preprocessing.py) is almost nothing but small 3x3 convs, and tt-metal publishes both its summed device
kernel time and its end-to-end time on Blackhole; `UnetShallow` issues the same ops with the same configurations
as that model,
written here from a reading of its source (not copied), with zero weights, so that the cost model can be run on
the op list the mock P150 produces for it and compared with the published time.

Published figure. tests/test_unet_perf.py::test_unet_perf_device (newest version read) expects, on Blackhole,
`AVG DEVICE KERNEL SAMPLES/S` = 2875.5 (margin 0.5 %; Wormhole: 1632). It profiles
`test_unet_perf.py::test_unet_model`, which runs the ttnn model UNET_DEVICE_TEST_TOTAL_ITERATIONS = 4 times
(batch 1, groups 4, program cache disabled), and divides `batch_size = groups * batch * 4 = 16` by the summed
DEVICE KERNEL DURATION of every device op of those 4 runs. A "sample" is therefore one 4-channel 1056 x 160 image,
and one inference (one `__call__`) carries 4 of them (the groups): 16 / 2875.5 = 5.564 ms for 4 inferences, i.e.
**1.391 ms of device kernel time per inference** (`PUBLISHED_KERNEL_MS`), 0.348 ms per image. This is the sum of
the ops' kernel durations (first core start to last core end, per op), so host dispatch and the gaps between
ops are not in it. (The first of the 4 runs also prepares the conv weights, which is host work here.)
For comparison, the end-to-end figure (test_unet_trace_perf: traced, 2 command queues, input and output
transfers included, median of 12 runs of 256 iterations) is 2532 images/s on Blackhole = 1.580 ms per inference
(`PUBLISHED_E2E_MS`). The perf tests accept an 11x10 or 13x10 grid; the mock P150 gives 13x10.

The network (per image: 4 input channels; the 4 images are folded into the channels and every conv is a
`groups=4` conv, so channel counts below are 4x the per-image ones):
input (1, 1, 16, 1056*160) bfloat16 row-major, width-sharded on 63 cores (16 x 2688 shards), as the test puts it
on the device -> `experimental.convert_to_hwc` (height-sharded HWC, 2688 x 16 shards, bfloat16) ->
4 down blocks (conv 3x3 + conv 3x3, `move`, `max_pool2d` 2x2/2): 16->64->64 @1056x160, 64->64->64 @528x80,
64->128->128 @264x40, 128->128->128 @132x20 -> bottleneck 128->256->256 @66x10 -> 4 up blocks (untilize both
inputs, nearest `upsample` x2, `reshard` onto the skip tensor's cores, grouped channel `concat(groups=4)`, three
3x3 convs): 384->128 @132x20, 256->128 @264x40, 192->64 @528x80, 128->64 @1056x160 (the last block tilizes both
concat inputs to bfloat8_b and `move`s the result, as the demo does for L1 pressure) -> 1x1 output conv 64->4
(bfloat16, no activation) -> `experimental.convert_to_chw` (width-sharded CHW).

Every conv: batch norm folded into the (zero) weights and bias, ReLU fused (`Conv2dConfig.activation`), weights
given as host float32 (out, in/groups, kh, kw) and converted by conv2d to `weights_dtype=bfloat8_b`, output
`dtype=bfloat8_b` (bfloat16 for the output layer) in TILE layout, height-sharded (`use_1d_systolic_array`),
LoFi without fp32 accumulation or packer L1 accumulation, `deallocate_activation`, weights double-buffered,
and per layer the demo's activation double-buffering, `enable_activation_reuse`, `act_block_h_override`,
`reshard_if_not_optimal` and `reallocate_halo_output` (table `CONVS`, Blackhole values).

On the mock P150 (ttnn 0.81.1) one call issues 87 device ops: 22 Conv2d + 1 Matmul (the 1x1 output conv),
26 Halo (one per 3x3 conv and per pool; conv outputs are TILE bfloat8_b, so each halo also untilizes), 9 Reshard
(5 from conv2d's reshard_if_not_optimal, 4 of the concats), 5 Move (ttnn.move and conv2d's reallocate_halo_output
each issue a Move only when the allocator would relocate the tensor: 2 of the 5 ttnn.move calls and 3 of the 4
halo reallocations do so on the mock), 4 Pool2D, 4 Upsample, 4 Concat, 8 (Un)tilize, ConvertToHWC, ConvertToCHW.
The first call issues the same ops (conv weights are prepared on the host).

Simplified or changed:
* The demo builds the memory configs of `concatenate` by editing the shard specs of its inputs' memory configs;
  here new MemoryConfigs are built with the same grid, orientation and shard shapes.
* Upsample core grid: the demo computes a core grid for the upsample input only when that input is interleaved;
  its conv outputs are sharded, so the untilized tensor is upsampled on its own sharding, and the skip tensor is
  never resharded before the concat. The same here (the interleaved branches are not transcribed).
* `experimental.convert_to_chw` takes no `memory_config` in ttnn 0.81.1; it infers the same width-sharded
  output (channels x the conv's shard height, on the conv's cores) that the demo spells out.
* The test writes the input with `from_torch(device=, memory_config=)`; here a host tensor and `to_device`
  (the same host-to-device write, no device op).
* The weights are zeros and nothing is checked against torch; the `.cpu()` read of the output is the caller's.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "UnetShallow",
    "CONVS",
    "GROUPS",
    "HEIGHT",
    "WIDTH",
    "PUBLISHED_KERNEL_MS",
    "PUBLISHED_E2E_MS",
]

GROUPS = 4  # images per inference, folded into the channels
HEIGHT, WIDTH = 1056, 160
IN_CHANNELS = 4 * GROUPS
PUBLISHED_KERNEL_MS = GROUPS / 2875.5 * 1e3  # test_unet_perf_device, summed device kernel time: 1.391 ms
PUBLISHED_E2E_MS = GROUPS / 2532.0 * 1e3  # test_unet_trace_perf (trace, 2 CQs), Blackhole: 1.580 ms
INPUT_CORES, INPUT_SHARD = 63, 2688  # the test's width sharding of the input, and convert_to_hwc's shard height


def _conv(c_in, c_out, h, w, *, k=3, block_h=0, reshard=False, reuse=False, dbuf=True, halo=False):
    return dict(
        c_in=c_in, c_out=c_out, h=h, w=w, k=k, block_h=block_h, reshard=reshard, reuse=reuse, dbuf=dbuf, halo=halo
    )


# name -> geometry (channels are for all 4 groups) and the demo's per-layer Conv2dConfig choices on Blackhole.
# block_h: act_block_h_override (0: ttnn's choice); reshard: reshard_if_not_optimal; reuse: enable_activation_reuse;
# dbuf: enable_act_double_buffer; halo: reallocate_halo_output (the first conv of every up block).
CONVS = {
    "c1": _conv(16, 64, 1056, 160, reshard=True, reuse=True),
    "c1_2": _conv(64, 64, 1056, 160, block_h=12 * 32),
    "c2": _conv(64, 64, 528, 80, reuse=True),
    "c2_2": _conv(64, 64, 528, 80, reuse=True),
    "c3": _conv(64, 128, 264, 40, reshard=True),
    "c3_2": _conv(128, 128, 264, 40),
    "c4": _conv(128, 128, 132, 20, reshard=True),
    "c4_2": _conv(128, 128, 132, 20),
    "bnc": _conv(128, 256, 66, 10, reshard=True, dbuf=False),
    "bnc_2": _conv(256, 256, 66, 10, dbuf=False),
    "c5": _conv(384, 128, 132, 20, reshard=True, dbuf=False, halo=True),
    "c5_2": _conv(128, 128, 132, 20, dbuf=False),
    "c5_3": _conv(128, 128, 132, 20, dbuf=False),
    "c6": _conv(256, 128, 264, 40, reshard=True, halo=True),
    "c6_2": _conv(128, 128, 264, 40),
    "c6_3": _conv(128, 128, 264, 40),
    "c7": _conv(192, 64, 528, 80, block_h=3 * 32, reshard=True, halo=True),
    "c7_2": _conv(64, 64, 528, 80, reuse=True),
    "c7_3": _conv(64, 64, 528, 80, reuse=True),
    "c8": _conv(128, 64, 1056, 160, block_h=4 * 32, halo=True),
    "c8_2": _conv(64, 64, 1056, 160, block_h=12 * 32),
    "c8_3": _conv(64, 64, 1056, 160, block_h=12 * 32),
    "output": _conv(64, 4, 1056, 160, k=1, block_h=42 * 32),
}
DOWN = (("c1", "c1_2"), ("c2", "c2_2"), ("c3", "c3_2"), ("c4", "c4_2"))
BOTTLENECK = ("bnc", "bnc_2")
UP = (("c5", "c5_2", "c5_3"), ("c6", "c6_2", "c6_3"), ("c7", "c7_2", "c7_3"), ("c8", "c8_2", "c8_3"))


class UnetShallow:
    """The demo's UNet shallow (batch 1, 4 groups) on `device`; the constructor uploads the (zero) weights."""

    def __init__(self, ttnn, device):
        T = self.ttnn = ttnn
        self.device = device
        self.weights = {}
        self.configs = {}
        for name, c in CONVS.items():
            w = np.zeros((c["c_out"], c["c_in"] // GROUPS, c["k"], c["k"]), np.float32)
            b = np.zeros((1, 1, 1, c["c_out"]), np.float32)
            self.weights[name] = (
                T.Tensor(w, T.float32, None, T.ROW_MAJOR_LAYOUT),
                T.Tensor(b, T.float32, None, T.ROW_MAJOR_LAYOUT),
            )
            cfg = T.Conv2dConfig(
                weights_dtype=T.bfloat8_b,
                shard_layout=T.TensorMemoryLayout.HEIGHT_SHARDED,
                deallocate_activation=True,
                enable_act_double_buffer=c["dbuf"],
                activation=None if name == "output" else T.UnaryWithParam(T.UnaryOpType.RELU),
                output_layout=T.TILE_LAYOUT,
                reshard_if_not_optimal=c["reshard"],
                reallocate_halo_output=c["halo"],
                enable_weights_double_buffer=True,
                enable_activation_reuse=c["reuse"],
            )
            if c["block_h"]:
                cfg.act_block_h_override = c["block_h"]
            self.configs[name] = cfg
        self.compute = T.init_device_compute_kernel_config(
            device.arch(), math_fidelity=T.MathFidelity.LoFi, fp32_dest_acc_en=False, packer_l1_acc=False
        )
        self.input_grid = T.CoreRangeSet(
            {T.CoreRange(T.CoreCoord(0, 0), T.CoreCoord(7, 6)), T.CoreRange(T.CoreCoord(0, 7), T.CoreCoord(6, 7))}
        )  # 56 + 7 = 63 cores

    # ------------------------------------------------------------------------------------------- input
    def input(self):
        """(1, 1, 16, 1056*160) bfloat16 row-major, width-sharded in L1 on 63 cores: what the perf test writes to
        the device (channels first, the 4 images' channels folded together, height and width flattened)."""
        T = self.ttnn
        mem = T.MemoryConfig(
            T.TensorMemoryLayout.WIDTH_SHARDED,
            T.BufferType.L1,
            T.ShardSpec(self.input_grid, [IN_CHANNELS, INPUT_SHARD], T.ShardOrientation.ROW_MAJOR),
        )
        x = T.Tensor(np.zeros((1, 1, IN_CHANNELS, HEIGHT * WIDTH), np.float32), T.bfloat16, None, T.ROW_MAJOR_LAYOUT)
        return T.to_device(x, self.device, memory_config=mem)  # as from_torch(device=, memory_config=) does

    # ---------------------------------------------------------------------------------------- the ops
    def _sharded(self, layout, grid, shape, orientation=None):
        T = self.ttnn
        return T.MemoryConfig(
            layout, T.BufferType.L1, T.ShardSpec(grid, list(shape), orientation or T.ShardOrientation.ROW_MAJOR)
        )

    def conv(self, x, name):
        T = self.ttnn
        c = CONVS[name]
        weight, bias = self.weights[name]
        pad = c["k"] // 2
        y, [weight, bias] = T.conv2d(
            input_tensor=x,
            weight_tensor=weight,
            bias_tensor=bias,
            device=self.device,
            in_channels=c["c_in"],
            out_channels=c["c_out"],
            batch_size=1,
            input_height=c["h"],
            input_width=c["w"],
            kernel_size=(c["k"], c["k"]),
            stride=(1, 1),
            padding=(pad, pad),
            dilation=(1, 1),
            groups=GROUPS,
            conv_config=self.configs[name],
            compute_config=self.compute,
            return_output_dim=False,
            return_weights_and_bias=True,
            dtype=T.bfloat16 if name == "output" else T.bfloat8_b,
        )
        self.weights[name] = (weight, bias)  # prepared on the first call, reused after
        return y

    def pool(self, x, h, w, channels):
        return self.ttnn.max_pool2d(
            input_tensor=x,
            batch_size=1,
            input_h=h,
            input_w=w,
            channels=channels,
            kernel_size=[2, 2],
            stride=[2, 2],
            padding=[0, 0],
            dilation=[1, 1],
        )

    def concat(self, up, skip, final: bool):
        """The demo's `concatenate`: reshard the upsampled tensor onto the skip tensor's cores (same shard
        height), then a height-sharded channel concat interleaving the 4 groups; in the final block both are
        first tilized to bfloat8_b."""
        T = self.ttnn
        if final:
            skip_t = T.to_layout(skip, T.TILE_LAYOUT, dtype=T.bfloat8_b)
            T.deallocate(skip)
            skip = skip_t
        sspec, uspec = skip.memory_config().shard_spec, up.memory_config().shard_spec
        s_h, s_w = sspec.shape
        layout = T.TensorMemoryLayout.HEIGHT_SHARDED
        out_mem = self._sharded(layout, sspec.grid, (s_h, s_w + uspec.shape[1]), sspec.orientation)
        x = T.reshard(up, self._sharded(layout, sspec.grid, (s_h, uspec.shape[1]), sspec.orientation))
        T.deallocate(up)
        if final:
            x_t = T.to_layout(x, T.TILE_LAYOUT, dtype=T.bfloat8_b)
            T.deallocate(x)
            x = x_t
        return T.concat([x, skip], dim=-1, memory_config=out_mem, groups=GROUPS)

    def up_block(self, x, skip, names, final: bool):
        T = self.ttnn
        c = CONVS[names[0]]
        h, w = c["h"], c["w"]  # the block's (upsampled) resolution
        x_rm = T.to_layout(x, T.ROW_MAJOR_LAYOUT)
        T.deallocate(x)
        skip_rm = T.to_layout(skip, T.ROW_MAJOR_LAYOUT)
        T.deallocate(skip)
        x4 = T.reshape(x_rm, (1, h // 2, w // 2, x_rm.shape[-1]))
        up = T.upsample(x4, (2, 2))
        T.deallocate(x4)
        up = T.reshape(up, (1, 1, h * w, up.shape[-1]))
        y = self.concat(up, skip_rm, final)
        if not final:  # the final block's concat has freed it (it tilizes a copy)
            T.deallocate(skip_rm)
        if final:
            y = T.move(y)
        for name in names:
            y = self.conv(y, name)
        return y

    def __call__(self, x):
        T = self.ttnn
        hwc = self._sharded(T.TensorMemoryLayout.HEIGHT_SHARDED, self.input_grid, (INPUT_SHARD, IN_CHANNELS))
        y = T.experimental.convert_to_hwc(x, memory_config=hwc, dtype=T.bfloat16)
        T.deallocate(x)
        skips = []
        for names in DOWN:
            for name in names:
                y = self.conv(y, name)
            y = T.move(y)
            skips.append(y)
            c = CONVS[names[-1]]
            y = self.pool(y, c["h"], c["w"], c["c_out"])
        for name in BOTTLENECK:
            y = self.conv(y, name)
        for i, names in enumerate(UP):
            skip = skips[len(skips) - 1 - i]
            y = self.up_block(y, skip, names, final=i == len(UP) - 1)
        y = self.conv(y, "output")
        out = T.experimental.convert_to_chw(y, dtype=T.bfloat16)  # 0.81.1 infers the width-sharded output itself
        T.deallocate(y)
        return out
