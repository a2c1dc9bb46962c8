"""Errors shared by the fabric and the planners above it."""


class Unrecoverable(Exception):
    """The change leaves the job unable to continue; the message names what was lost."""
