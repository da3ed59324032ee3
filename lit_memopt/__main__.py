"""``python -m lit_memopt`` runs the ``lit-memopt`` command."""

from lit_memopt.cli import main

raise SystemExit(main())
