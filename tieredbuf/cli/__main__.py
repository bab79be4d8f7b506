"""``python -m tieredbuf.cli``: the ``tieredbuf`` command."""

from tieredbuf.cli import run

run()
