"""Error types. Each message says what was wrong, where, and what to do."""


class PolicyscanError(Exception):
    """Base class: the CLI prints these without a traceback."""


class CheckpointError(PolicyscanError):
    """A model directory that cannot be loaded."""


class PolicyError(PolicyscanError):
    """A policy bundle that does not fit the model."""


class InputError(PolicyscanError):
    """An input file or row that cannot be read or scored."""
