"""Stopping cleanly when the machine is taken away: SIGTERM or SIGINT ends the run after the
current step, with a checkpoint of that step, and every process stops at the same step.

One process: the signals are caught here. Several processes: JAX's preemption service (started
by jax.distributed) catches SIGTERM on any process and `reached_preemption_sync_point` turns it
into one step at which every process stops; SIGINT keeps its default there (a Ctrl-C on one
process alone cannot be agreed on without a collective every step). The launchers forward their
own SIGTERM / SIGINT to every process as SIGTERM.
"""

from __future__ import annotations

import os
import signal
import threading

import jax
from absl import logging
from jax.experimental import multihost_utils


class PreemptionWatch:
  """Tells the training loop, once per step, whether to stop after it."""

  def __init__(self):
    self.several_processes = jax.process_count() > 1
    self.signal_name: str | None = None
    self._previous = {}
    if not self.several_processes and threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._previous[sig] = signal.signal(sig, self._received)

  def _received(self, signum, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    if self.signal_name:  # A second signal: stop at once, as without this watch.
      signal.signal(signum, signal.SIG_DFL)
      os.kill(os.getpid(), signum)
      return
    self.signal_name = name
    logging.warning('%s received: finishing this step, saving a checkpoint, then stopping '
                    '(send it again to stop at once).', name)

  def stop_after(self, step: int) -> bool:
    """Whether to checkpoint `step` and stop; the same answer on every process."""
    if self.several_processes:
      if multihost_utils.reached_preemption_sync_point(step):
        self.signal_name = 'a preemption notice (SIGTERM)'
        return True
      return False
    return self.signal_name is not None

  def close(self) -> None:
    """Gives the signals back to whoever had them."""
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}
