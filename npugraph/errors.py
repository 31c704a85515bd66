"""The runtime's exceptions: one hierarchy rooted in :class:`NpuGraphError`.

Messages name the namespace, graph key, layer and argument at fault, and say what to do.
"""

from __future__ import annotations

__all__ = [
    "NpuGraphError",
    "ConfigError",
    "DeviceUnavailable",
    "CaptureFailed",
    "UnknownKeyError",
    "MetadataError",
    "BatchRefused",
    "NotReplayableError",
    "UpdateFailed",
    "ReplayFailed",
    "GraphDeadlock",
    "GraphRace",
    "PolicyError",
    "StepOrderWarning",
]


class NpuGraphError(Exception):
    """Base of every error npugraph raises.

    ``postmortem`` is the path of the post-mortem dump written for this error, if any.
    """

    postmortem: str | None = None


class ConfigError(NpuGraphError, ValueError):
    """A runtime, capture or step was configured with a value it cannot use."""


class DeviceUnavailable(NpuGraphError):
    """The requested device (real torch_npu) cannot be loaded here."""


class CaptureFailed(NpuGraphError):
    """The captured callable raised; nothing was registered for that key."""


class UnknownKeyError(NpuGraphError, KeyError):
    """A key was replayed or updated that was never captured."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class MetadataError(NpuGraphError, ValueError):
    """The step's metadata is missing a layer or holds invalid lengths or block ids."""


class BatchRefused(MetadataError):
    """The graph's padding rule refuses the step's batch (:func:`npugraph.metadata.batch_refusal`):
    too many requests or query tokens for the graph, spare tokens with no padding row, or several
    query tokens per request for a kernel that runs one.  Raised before any device call; an
    engine that runs such a batch eagerly steps with ``refusable=True`` and catches it."""


class NotReplayableError(NpuGraphError):
    """The graph's last update failed part-way; a complete update must succeed first."""


class UpdateFailed(NpuGraphError):
    """A device call failed while updating a graph (it is now not replayable)."""


class ReplayFailed(NpuGraphError):
    """The device failed while running a graph (the rest of that replay is cancelled).

    The graph refuses to replay until a complete update succeeds.
    """


class GraphDeadlock(NpuGraphError):
    """The device would hang: a graph waits on an event that is never recorded."""


class GraphRace(NpuGraphError):
    """Two device operations raced (lost event record, update overtaking a replay)."""


class PolicyError(NpuGraphError, ValueError):
    """A kernel-policy file does not match this model or device."""


class StepOrderWarning(UserWarning):
    """A half step discarded work nobody ran: an update no replay ran, or a replay that was
    waiting for its update.  The runtime goes on (the step protocol's table says how);
    the warning names the graph and the order at the call that made the mistake, once per
    graph and kind.  ``warnings.simplefilter("error", StepOrderWarning)`` makes it raise."""
