"""Errors the simulated device raises where real hardware would hang or corrupt memory."""

from __future__ import annotations

from typing import Any

__all__ = [
    "SimError",
    "DeadlockError",
    "RaceError",
    "WorkspaceTooSmall",
    "CaptureError",
    "UpdateMismatchError",
    "UseAfterFree",
    "ReplayFault",
    "ConcurrentUpdateError",
]


class SimError(RuntimeError):
    """Base of every error the simulator raises on its own account."""


class DeadlockError(SimError):
    """Work is queued behind a wait that nothing will ever satisfy.

    On hardware the stream blocks and the next synchronize fails after a device
    timeout (error 507011, ~30 minutes).  ``blocked`` lists what each stuck stream
    waits for: dicts with the ``stream``, ``graph``, ``event`` and ``task_group``
    objects (``None`` where not applicable), so a runtime can name its own layers.
    """

    def __init__(self, message: str, blocked: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.blocked = blocked or []


class RaceError(SimError):
    """Two stream operations raced in a way that gives wrong output or a later hang.

    ``event``, ``task_group`` and ``graph`` carry the objects involved (or ``None``).
    """

    def __init__(
        self,
        message: str,
        *,
        event: Any = None,
        task_group: Any = None,
        graph: Any = None,
    ) -> None:
        super().__init__(message)
        self.event = event
        self.task_group = task_group
        self.graph = graph


class WorkspaceTooSmall(SimError):
    """A kernel ran with a workspace smaller than its current arguments need.

    This is a simulator check: torch_npu never size-checks the workspace, and the
    hardware silently corrupts memory instead.
    """


class CaptureError(SimError):
    """Something was done during capture that a real NPU graph capture forbids."""


class UpdateMismatchError(SimError):
    """The op issued inside a task update differs from the op captured in that group."""


class UseAfterFree(SimError):
    """A kernel or copy ran on memory its owner freed after the graph captured (or an
    update pointed the task at) it.  Hardware reads or corrupts whatever lives there now.

    ``argument`` names the kernel argument; the message names graph and task.
    """

    def __init__(self, message: str, *, argument: str = "") -> None:
        super().__init__(message)
        self.argument = argument


class ReplayFault(SimError):
    """A kernel or op of a replay failed on the device; the rest of that replay was cancelled.

    Also the fault of an eager op or kernel queued on a stream that failed after the call
    that issued it had returned (``graph`` is ``None`` then).

    A replay is asynchronous, so (as on hardware, where the error comes back from the
    next ``aclrtSynchronize*``) the fault is raised by the next synchronize, not by the
    call that happened to run the work.  ``graph`` is the simulated graph, ``node`` the
    index of the node that failed, ``task_group`` its task group (or ``None``),
    ``waits_skipped`` the ExternalEvents whose waits the cancelled rest of the replay did
    not run (and whose flags are set), ``others`` the later faults the same synchronize
    found, and ``__cause__`` the original error.
    """

    def __init__(
        self,
        message: str,
        *,
        graph: Any = None,
        node: int = -1,
        task_group: Any = None,
        waits_skipped: tuple[Any, ...] = (),
    ) -> None:
        super().__init__(message)
        self.graph = graph
        self.node = node
        self.task_group = task_group
        self.waits_skipped = waits_skipped
        self.others: tuple[ReplayFault, ...] = ()


class ConcurrentUpdateError(SimError):
    """Two task-group update sessions overlapped (threads or streams).

    CANN's task-update guide (aclmdlRICaptureTaskUpdateBegin/End): "a task group is like
    a critical resource; concurrent updates from multiple threads or multiple streams
    are not supported, otherwise the update results are unexpected."
    """
