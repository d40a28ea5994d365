"""``python -m kvcanary``: the ``kvcanary`` command."""

import sys

from kvcanary.cli.command import main

sys.exit(main())
