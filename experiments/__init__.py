"""The experiment files: each a `get_config(arg)` that commands load by path
(`--config=experiments/tiny.py:ARGS`), its docstring with the command that runs it.
`common.py` holds what several of them share; installed with the engine, so that
`experiments.common` imports from any directory.
"""
