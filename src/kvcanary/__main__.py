"""``python -m kvcanary``: the ``kvcanary`` command."""

import sys

from kvcanary.cli import main

sys.exit(main())
