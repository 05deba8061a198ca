"""The processes' logging: their own lines shown at the default level, repeated ones held back.

Faust sets up the root logger at the process's `--loglevel` (warn by default). Two things are
added to that, here and in `memfilter.runtime.process`, which installs them:
- the worker's own logger, `memfilter`, shows at info whatever the level (unless asked for
  `error` or `crit`): an operator sees it start and get its partitions;
- a message that repeats (the same logger and text, whatever numbers are in it: node ids,
  ports, delays) is shown once per REPEAT_WINDOW_S; the next one shown says how many were
  held back. Text that differs otherwise (another reason for the same failure) shows. A broker restart makes
  aiokafka log one error per request in flight, hundreds a second, and a log that floods
  hides what matters. Critical lines are never held back.
"""

from __future__ import annotations

import logging
import re
import time

REPEAT_WINDOW_S = 10.0
_DIGITS = re.compile(r"\d+")


class Repeats(logging.Filter):
    """Lets each warning or error through once per `window` seconds; counts what it holds back."""

    def __init__(self, window: float = REPEAT_WINDOW_S):
        super().__init__()
        self.window = window
        self.seen: dict[tuple[str, str], tuple[float, int]] = {}  # (logger, message without numbers) -> (last shown, held back since)

    def filter(self, record: logging.LogRecord) -> bool:
        if not logging.WARNING <= record.levelno < logging.CRITICAL:
            return True
        key = (record.name, _DIGITS.sub("#", record.getMessage()))
        now = time.monotonic()
        shown, held = self.seen.get(key, (-self.window, 0))
        if now - shown < self.window:
            self.seen[key] = (shown, held + 1)
            return False
        self.seen[key] = (now, 0)
        if held:
            record.msg = f"{record.msg} [and {held} more like it in the last {now - shown:.0f} s]"
        return True


# aiokafka's errors that are a normal step, not a failure: logged at info (shown with
# --loglevel info or debug). The group coordinator is "not available" while a new cluster
# makes its offsets topic, at every first start.
NORMAL = {"aiokafka.consumer.group_coordinator": re.compile(r"^Group Coordinator Request failed: \[Error 15\] GroupCoordinatorNotAvailableError")}


class Normal(logging.Filter):
    """Demotes the errors in NORMAL to info."""

    def filter(self, record: logging.LogRecord) -> bool:
        pattern = NORMAL.get(record.name)
        if pattern is not None and record.levelno == logging.ERROR and pattern.match(record.getMessage()):
            record.levelno, record.levelname = logging.INFO, "INFO"
            return logging.getLogger().isEnabledFor(logging.INFO)
        return True
