"""Errors shared by the fabric and the planners above it."""


class Unrecoverable(Exception):
    """The change leaves the job unable to continue; the message names what was lost."""


class TooFewRanks(Unrecoverable):
    """Fewer ranks are left than the pipeline has stages, though no state is lost: the
    job may wait for ``needed`` more ranks (joiners) instead of stopping."""

    def __init__(self, message: str, needed: int, committed_step: int = -1) -> None:
        super().__init__(message)
        self.needed = needed
        self.committed_step = committed_step
        """The step every survivor rolls back to (-1: not known where raised)."""
