"""One source of truth for the numbers the model, the host code, the server and the CLI share."""

DEFAULT_CANVAS = (1920, 1080)  # (width, height) every image is fitted onto; the fixed forward shape
DEFAULT_NUM_TOKENS = 1800  # ViT patch tokens for the canvas
MIN_IMAGE_SIDE = 8  # smallest input width/height we accept
PAD_GRAY = 128  # uint8 value of the letterbox bars of fit="pad"
FITS = ("pad", "stretch")
# A given horizontal field of view lies strictly inside, in degrees: (0, 180) less a margin of 1e-3 degrees at each
# end. Closer to 0 the focal length (0.5 / tan(fov_x / 2) image widths) overflows float32 (fov_x=1e-300 gave inf
# intrinsics and fov_x_deg 0); closer to 180 it underflows towards 0 and the points run off to infinity. Within
# the margin the focal stays between 4.4e-6 and 5.7e4 image widths, so intrinsics, points and fov_x stay finite.
FOV_X_MARGIN = 1e-3
FOV_X_RANGE = (FOV_X_MARGIN, 180.0 - FOV_X_MARGIN)
MASK_THRESHOLD = 0.5  # a pixel is valid where the mask probability exceeds this
SOLVE_GRID = (64, 64)  # (height, width) of the nearest-neighbour grid the focal/shift solve runs on
MAX_CANVAS_SIDE = 4096
PRECISIONS = (
    "auto",
    "fp32",
    "bf16",
    "fp16",
    "int8",
    "bfp8",
)  # precision= of from_pretrained (see runners/precision.py)
DEPTH_EDGE_RTOL = 0.04  # 3D exports drop a pixel whose 3x3 neighbourhood spans more than this share of its depth
