"""Collective reads: merge every rank's small sample reads into a few large ones."""
