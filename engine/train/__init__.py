"""The training loop and the hooks it calls.

  loop.py        `train(config, workdir)`: the start, compiled steps, the step loop, the report
  clock.py       the loop's one clock: each step's phases timed once, for every reader
  hooks.py       the protocol the step loop calls its hooks by; the checkpoints and eval hooks
  metrics.py     each log point's scalars (throughput, MFU, memory) for the loggers
                 (engine/loggers/), and the log's line
  finiteness.py  a step whose loss or gradient norm is not finite stops (or is skipped)
  preemption.py  SIGTERM / SIGINT end the run after a checkpoint, every process at one step
  profiling.py   a jax.profiler trace of a range of steps
  samples.py     text sampled from the model every train.sample_every steps
  goodput.py     the share of the wall time in productive steps, the rest by cause
  watchdog.py    a run that makes no progress ends naming whom it waits for; stragglers
"""
