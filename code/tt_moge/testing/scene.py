"""The analytic scene with exact ground truth, as the tests and benchmarks name it: `tt_moge.scene` (the library's
own copy, which also renders the web page's demo photo), re-exported here."""

from ..scene import *  # noqa: F403
from ..scene import __all__  # noqa: F401
