"""Process settings around JAX, applied before its backends start.

  allocator.py       glibc's malloc kept from returning memory between CPU steps
  platforms.py       which JAX platforms to start (CPU where libtpu is installed but no TPU is)
  library_output.py  the libraries' chatter quieted, their tracebacks for explained errors hidden
  log_format.py      the short log lines (`I 12:03:04 message`), absl's full ones under --verbosity=1
"""
