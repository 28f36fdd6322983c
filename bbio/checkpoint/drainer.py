"""``python -m bbio.checkpoint.drainer --journal DIR [--parent PID]``: the background drain
process (:func:`bbio.checkpoint.drain.main`).

A module of its own: run as ``python -m bbio.checkpoint.drain``, the drain module
would be imported by ``bbio`` and then run again as ``__main__``, two copies of it
in one process (Python warns of that in every drain's log).
"""

import sys

from bbio.checkpoint.drain import main

if __name__ == "__main__":
    sys.exit(main())
