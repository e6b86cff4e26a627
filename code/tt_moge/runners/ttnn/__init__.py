"""The Tenstorrent (ttnn) runner: weight preparation and the host references of the steps around the network
(`prepare`, torch only inside `prepare_weights`), the device graph (`graph`, numpy + an injected ttnn module; one
module per network part: `patch_embed`, `vit_block`, `encoder`, `decoder`, `heads`) with
its input and output sides on the device (`pre`: canvas -> patch matrix; `post`: finest maps -> raw maps), finding
and opening a chip (`device`) and the runner the API uses (`runner.TtnnRunner`, torch on the host side); the mock-
device check and the cost model are tools beside it (`tt_moge.ttnn_tools`), never imported by it. Importing this
package imports neither torch nor ttnn (the mock check runs where there is no torch); `runner` is imported by
`runners.make_runner` only for a Tenstorrent device."""

from .graph import FORMATS, Formats, TtnnGraph
from .prepare import Prepared, host_input, host_output, prepare_weights

__all__ = ["FORMATS", "Formats", "Prepared", "TtnnGraph", "host_input", "host_output", "prepare_weights"]
