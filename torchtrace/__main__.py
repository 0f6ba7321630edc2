"""``python -m torchtrace``: the same as the ``torchtrace`` command."""

from torchtrace.cli import main

raise SystemExit(main())
