"""`python -m engine.analysis.tokenizer_check --transformers_python=PY`: the engine's exported
tokenizers against transformers' AutoTokenizer on a long text.

  __main__.py     the command
  engine_side.py  a tokenizer of each kind trained, each family's export written, the engine's
                  ids compared with AutoTokenizer's (references/tokenizer_reference.py), the report
"""
