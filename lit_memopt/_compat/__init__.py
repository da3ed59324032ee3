"""The one seam through which the pack touches private torch and Lightning names; ``tests/test_compat.py`` trips.

One module per library; each function (or re-export) wraps one private name and says why no public API does the job:

- :mod:`.torch`: core torch (fake tensors, dispatch modes, pytree, op internals, the allocator history, ...). No
  Lightning: ``lit_memopt.ops`` imports it.
- :mod:`.distributed`: ``torch.distributed`` (FSDP2's param groups and collectives, the activation-checkpoint wrapper).
- :mod:`.mem_tracker`: PyTorch's ``MemTracker`` with its private hooks and state under public names.
- :mod:`.lightning`: Lightning (``ModelCheckpoint``, the fit loop, the module's trainer, the progress bar).

Each module's ``PRIVATE_NAMES`` maps the private names it wraps to its own names; the tripwire test checks each one
against the installed versions and fails naming the function to fix here, and a second test fails when a private name
is used anywhere else in the pack. The pack imports the library modules directly (``from lit_memopt._compat.torch
import is_fake``), so that import-linter sees what each layer really loads; this package itself imports none of them.
"""

from __future__ import annotations

#: the library modules of the seam, in the order the tests report them
SUBMODULES = ("torch", "distributed", "mem_tracker", "lightning")
