"""Errors of the graph layer that several of its modules raise."""


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded as the config describes."""
