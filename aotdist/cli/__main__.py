"""``python -m aotdist.cli``: the ``aotdist`` command (``aotdist zoo`` runs each check so)."""

import sys

from aotdist.cli import main

sys.exit(main())
