"""Whole training runs and what they leave in their workdir: resume, checkpoints, metrics, locks."""
