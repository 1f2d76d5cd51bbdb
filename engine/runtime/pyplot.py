"""Matplotlib's pyplot, imported on the first figure: the import costs about half a second,
which every command and every process of a pod would otherwise pay at start-up."""

import functools


@functools.cache
def pyplot():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')  # Files only; no display on training machines.
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt
