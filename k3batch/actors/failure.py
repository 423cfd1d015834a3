"""How a replica's failure reaches the driver with its cause.

A replica whose engine, or one of whose prefill stages or decode ranks, fails does not exit: it
keeps its process and raises `ReplicaFailed` from every call after that (`submit`,
`take_results`, `ready`). The exception carries the cause as plain data (the exception's type,
its message and the last lines of its traceback, `describe`) and the Ray nodes the replica's
members ran on, so the driver can print why, write it into the report, and tell the replica's
own failure from its node's loss from facts (the GCS node table, `driver.health`). The driver
then restarts the process (`ray.kill(no_restart=False)`). A replica that cannot be built raises
from its constructor: Ray ends the actor with that error and its traceback.
"""

import traceback

TRACEBACK_LINES = 12  # of the innermost frames, kept with a cause


def describe(error: BaseException) -> dict:
    """{"type", "message", "traceback"}: the exception's class name, its message and the last
    `TRACEBACK_LINES` lines of its formatted traceback (chained causes included)."""
    lines = "".join(traceback.format_exception(error)).rstrip().splitlines()
    return {
        "type": type(error).__name__,
        "message": str(error),
        "traceback": "\n".join(lines[-TRACEBACK_LINES:]),
    }


def cause_line(cause: dict) -> str:
    """One line of a cause: "Type: message" (the message's first line)."""
    first = cause["message"].strip().splitlines()[0] if cause["message"].strip() else ""
    return f"{cause['type']}: {first}" if first else cause["type"]


class ReplicaFailed(Exception):
    """Raised by every call of a replica that failed. details: `describe` of the first failure,
    plus "where" (what failed: "engine", "prefill stage 1", ...); nodes: the Ray node ids the
    replica and its members ran on."""

    def __init__(self, details: dict, nodes: list[str]):
        super().__init__(f"{details.get('where', 'replica')} failed: {cause_line(details)}")
        self.details, self.nodes = details, nodes

    def __reduce__(self):
        return ReplicaFailed, (self.details, self.nodes)
