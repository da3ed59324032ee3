"""``python -m lit_memopt`` runs the ``lit-memopt`` command."""

from lit_memopt.cli import console_main

console_main()
