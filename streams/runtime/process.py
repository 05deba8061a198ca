"""A running worker or agent runner as a process: Faust's worker, with the product's logging and
a bounded shutdown.

Faust (mode) runs the process: its event loop, its services, its signals. Two things are
changed, here and nowhere else:
- logging: the `memfilter` logger shows at info whatever `--loglevel` is (unless asked for
  `error` or `crit`), and repeated warnings are held back (`memfilter.runtime.logs.Repeats`);
- shutdown: SIGTERM or SIGINT stops the process within MEMFILTER_SHUTDOWN_S, in every state.
  A clean stop (the batch in hand committed, the producers and consumer closed) usually takes
  well under that; one that cannot finish (Redis or the model not answering, a broker gone)
  is cut short when the time is up, and whatever was not committed is left to the next owner
  of its partitions, exactly as after a crash. Either way the log ends with one line saying
  the process stopped, not a screen of mode's `-INT-`.

mode's signal handlers (`Worker._on_sigint`, `_on_sigterm`, `_schedule_shutdown`) are private:
`WRITTEN_FOR` names the mode-streaming release line they were read in, and
`tests/unit/test_house.py` fails on another.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

import faust

from memfilter.runtime.logs import Normal, Repeats

WRITTEN_FOR = "0.7"  # mode-streaming's release line
log = logging.getLogger("memfilter")


class Worker(faust.Worker):
    """A Faust worker whose log shows the `memfilter` lines, holds back repeats, and which stops
    within `shutdown_s` of a signal."""

    def __init__(self, app: faust.App, loglevel: str, name: str = "worker", shutdown_s: float = 10.0) -> None:
        super().__init__(app, loglevel=loglevel)
        own = {"crit": logging.CRITICAL, "error": logging.ERROR, "debug": logging.DEBUG}.get(loglevel, logging.INFO)
        logging.getLogger("memfilter").setLevel(own)
        # Faust's terminal spinner sets the root logger to DEBUG so that every record spins it:
        # aiokafka then formats a debug line per record sent, 6% of the worker's time.
        self.spinner = None
        self.name = name
        self.shutdown_s = shutdown_s
        self._deadline: threading.Timer | None = None

    def on_setup_root_logger(self, logger: logging.Logger, level: int) -> None:
        super().on_setup_root_logger(logger, level)
        for handler in logger.handlers:
            handler.setLevel(logging.NOTSET)  # the loggers' levels decide (the root's: --loglevel)
            handler.addFilter(Normal())
            handler.addFilter(Repeats())

    def _on_sigint(self) -> None:
        self._stop_within(signal.SIGINT)

    def _on_sigterm(self) -> None:
        self._stop_within(signal.SIGTERM)

    def _stop_within(self, received: signal.Signals) -> None:
        if self._deadline is None:
            log.info("memfilter %s: %s received; stopping within %g s (MEMFILTER_SHUTDOWN_S)", self.name, received.name, self.shutdown_s)
            self._deadline = threading.Timer(self.shutdown_s, self._cut_short, args=(received,))
            self._deadline.daemon = True
            self._deadline.start()
        self._schedule_shutdown(received)

    def _cut_short(self, received: signal.Signals) -> None:
        """The time is up: exit now, as a crash would, leaving what was not committed to the next owner."""
        log.warning(
            "memfilter %s stopped: not done within %g s of %s; what it had not committed is left to the next owner of its partitions",
            self.name,
            self.shutdown_s,
            received.name,
        )
        logging.shutdown()
        sys.stderr.flush()
        os._exit(128 + received.value)

    def stop_and_shutdown(self) -> None:
        super().stop_and_shutdown()
        if self._deadline is not None:
            self._deadline.cancel()
        log.info("memfilter %s stopped", self.name)
