"""Outside implementations, each run as a script by another Python (one with torch or
transformers) in a child process: the engine imports none of them (only `script`, their
paths), and they import nothing from it.

  torch_reference.py      the Shakespeare GPT in eager PyTorch (engine.bench --torch_python)
  hf_reference.py         transformers' side of engine.analysis.hf_check: tiny models, logits
  tokenizer_reference.py  AutoTokenizer's side of engine.analysis.tokenizer_check
  transformers_output.py  what transformers says in those children, collected (imported by
                          them as a sibling file)
"""

import os


def script(name: str) -> str:
  """The path of the reference script `name` ('hf_reference.py'), for a child's command line."""
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
