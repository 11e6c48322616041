"""``python -m switchagg`` is the ``switchagg`` command."""

import sys

from .cli import main

sys.exit(main())
