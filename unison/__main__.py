"""``python -m unison COMMAND``: the same as the ``unison`` console script."""

import sys

from .apps.cli import main

sys.exit(main())
