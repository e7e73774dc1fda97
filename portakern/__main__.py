"""``python -m portakern``: the same command line as the ``portakern`` script (see ``portakern.cli``)."""

import sys

from portakern.cli import main

sys.exit(main())
