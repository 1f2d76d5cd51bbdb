"""Process settings around JAX, applied before its backends start, and the console's progress
lines.

  allocator.py       glibc's malloc kept from returning memory between CPU steps
  platforms.py       which JAX platforms to start (CPU where libtpu is installed but no TPU is)
  library_output.py  the libraries' chatter quieted, their tracebacks for explained errors hidden
  progress.py        progress lines of long work: a phase's time, a loop's count and time left
  log_format.py      the short log lines (`I 12:03:04 message`), absl's full ones under --verbosity=1
  compile_cache.py   JAX's persistent compilation cache for a run, and what it read back
  pyplot.py          matplotlib's pyplot, imported for the first figure drawn
"""
