"""``python -m bbio`` is the ``bbio`` command."""

import sys

from bbio.cli import main

sys.exit(main())
