"""When this program began, as fw can tell: the moment fw was first imported, and the CPU time the process had
used by then. `fw.warm.startup` dates a process from it when a shell exec'd fw after other work, which /proc's
fork time does not show."""

from __future__ import annotations

import time

IMPORTED_AT = (time.monotonic(), time.process_time())
