"""``npugraph.sim``: the simulator's name before it became its own package, :mod:`npusim`.

Kept for code that imports it: ``npugraph.sim`` *is* the module ``npusim`` and
``npugraph.sim.x`` is ``npusim.x`` (the same module objects, not copies, so the simulator's
state is one).  Importing it needs ``npugraph[sim]``; ``import npugraph`` never imports it.
"""

from __future__ import annotations

import sys

import npusim
from npusim.surfaces.aliases import PackageAlias

PackageAlias(__name__, "npusim").install()  # npugraph.sim.<submodule> -> npusim.<submodule>
sys.modules[__name__] = npusim
