"""Launchers: parallel3d-run (validated torchrun)."""

