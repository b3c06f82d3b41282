"""Exceptions that cross module boundaries."""


class BackendFailed(RuntimeError):
    """A backend could not load or launch a kernel, before anything ran: under backend='auto' the call, and
    the rest of the process, take another backend (dispatch.py)."""
