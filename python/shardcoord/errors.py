"""Typed errors of shardcoord. Every error carries the coordinator's (or the worker's) message.

The class follows the gRPC status code of the failure, so a trainer can catch what it can act on:

    try:
        d = worker.get_decision(step, mb, timeout=30)
    except shardcoord.GroupFailed as e:      # ABORTED: a rank of the group died; e names it
        ...
    except shardcoord.Unavailable:           # the coordinator is gone
        ...
"""


class Error(Exception):
    """Base class. ``code`` is the canonical status code (an int, as grpc.StatusCode values)."""

    code = 2  # UNKNOWN

    def __init__(self, message, code=None):
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self):
        return self.args[0] if self.args else ""


class Cancelled(Error):
    code = 1


class InvalidArgument(Error, ValueError):
    """Bad input: a negative step, an unknown module, a malformed option."""

    code = 3


class DeadlineExceeded(Error, TimeoutError):
    """A wait ran out: no decision in time, registration not answered."""

    code = 4


class NotFound(Error, LookupError):
    code = 5


class AlreadyExists(Error):
    """The rank is already live in another session."""

    code = 6


class PermissionDenied(Error):
    code = 7


class ResourceExhausted(Error):
    """A bound was hit (lookahead window, a coordinator cap); the message names it."""

    code = 8


class FailedPrecondition(Error):
    """The call does not fit the state: out-of-order plan, manifest or policy mismatch, a
    microbatch that can never be decided."""

    code = 9


class GroupFailed(Error):
    """ABORTED: the shard group failed (a member died; the message names it) or the plan was
    made before the failure. Wait for the group to re-form (``await_group_ready``)."""

    code = 10


class OutOfRange(Error):
    code = 11


class Unimplemented(Error):
    code = 12


class Internal(Error):
    code = 13


class Unavailable(Error, ConnectionError):
    """The coordinator cannot be reached or the session was lost."""

    code = 14


class Unauthenticated(PermissionDenied):
    """UNAUTHENTICATED: the coordinator requires a token (``--token-file``) and this one is missing
    or wrong; the message says which. A PermissionDenied, for handlers written before it existed."""

    code = 16


_BY_CODE = {
    cls.code: cls
    for cls in (Cancelled, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists, PermissionDenied,
                ResourceExhausted, FailedPrecondition, GroupFailed, OutOfRange, Unimplemented, Internal, Unavailable,
                Unauthenticated)
}


def raise_for_code(code, message):
    """Raises the Error subclass for a status code (used by the native module)."""
    raise _BY_CODE.get(code, Error)(message, code)
