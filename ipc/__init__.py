# The protocol first: ``ipc.metrics_types`` and ``ipc.protocol`` import each other (the summary's recent chunks
# hold a ``ChunkControl``; ``Closed`` holds a summary), which works when the protocol module starts the cycle.
import ipc.protocol  # noqa: F401
