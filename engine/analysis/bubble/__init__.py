"""`python -m engine.analysis.bubble`: a pipeline's bubble measured from step times at several
micro-batch counts (__main__.py, the command and its fit)."""
