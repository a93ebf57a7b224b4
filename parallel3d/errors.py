"""The error every configuration problem raises: one line naming the key, the value and the fix.

Apart from validate.py so that modules validate.py calls (parallel3d/data/checks.py) can raise it.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run, explained for the person who wrote it."""

    def __init__(self, key: str, value: object, problem: str, fix: str):
        self.key, self.value = key, value
        super().__init__(f"{key}={value}: {problem}. Fix: {fix}.")
