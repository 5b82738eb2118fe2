"""`retarget.utils`: the import path of `accelerate.utils`, so a script migrates by changing
`accelerate` to `retarget` in its import lines.

    from retarget.utils import set_seed, find_executable_batch_size, LocalSGD, gather_object

The helpers live in the Accelerate compatibility layer (`retarget/compat/accelerate/utils/`);
this module only re-exports them. It sits at the top of the layer stack: nothing imports it.
"""

from retarget.compat.accelerate.utils import *  # noqa: F403
from retarget.compat.accelerate.utils import __all__  # noqa: F401
