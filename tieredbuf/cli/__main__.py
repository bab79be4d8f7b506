"""``python -m tieredbuf.cli``: the ``tieredbuf`` command."""

import sys

from tieredbuf.cli import main

sys.exit(main())
