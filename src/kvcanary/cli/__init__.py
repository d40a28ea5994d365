"""The ``kvcanary`` command: :mod:`.command` (parser and subcommands; ``main``, the console
script ``kvcanary.cli:main``), :mod:`.args` (flags generated from the config dataclasses),
:mod:`.run` and :mod:`.selftest` (the workload and self-test drivers), :mod:`.report`
(tables and JSON)."""

from kvcanary.cli.command import main

__all__ = ["main"]
