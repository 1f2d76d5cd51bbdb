"""`python -m engine.analysis.hf_check --torch_python=PY`: the engine's Hugging Face families
against transformers itself.

  __main__.py     the command: its flags and what the check proves
  checker.py      its runs: the transformers child (references/hf_reference.py), every family x
                  config format x mode checked, the Markdown report
  engine_side.py  one checkpoint loaded as train.init_from=hf:DIR does, measured in one mode and
                  compared with transformers' numbers
"""
