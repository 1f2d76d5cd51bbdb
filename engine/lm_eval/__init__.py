"""A finished run evaluated by EleutherAI's lm-eval harness (`python -m engine.lm_eval`; the
`lm_eval` extra).

  scoring.py   continuations' log-likelihoods and greedy matches on the run's forward pass
  harness.py   the run as an lm-eval model: log-likelihood, rolling, generation requests
  __main__.py  the command: tasks chosen, evaluated, the table printed and written
"""
