"""Tools that measure and explain the engine; the core (engine/*, models/, parallel/) never
imports them.

  reference.py       the single-device computation every layout must reproduce
  collectives.py     counts the collectives of a compiled step by kind and mesh axes
  hlo_loops.py       reads the trip counts of compiled loops that do not record them (TPU)
  hlo_matmuls.py     the matrix products of a compiled program, by operand types
  comm_theory.py     the bytes a layout should move, from the model's spec and the rules
  slices.py          that theory as a step over several slices runs it (its data-centre share)
  verdicts.py        which collectives move bytes off their theory, and the known reasons why
  benchmark.py       step time, FLOP/s, memory and collectives of modes x meshes, interleaved
                     in one run (command: python -m engine.bench)
  torch_reference.py the GPT in PyTorch, a child process the bench can interleave (not imported)
  comparison.py      auto against manual against the reference: numerics, speed, memory, bytes
  compare.py         comparison's command (python -m engine.analysis.compare)
  compare_report.py  the comparison as Markdown, JSON and plots
  layout.py          prints and draws where every parameter and the batch live on the mesh
  show_layout.py     layout's command (python -m engine.analysis.show_layout)
  bubble.py          measures a pipeline's bubble from step times at several micro-batch counts
  hf_check.py        the engine against transformers itself on each Hugging Face family
                     (command: python -m engine.analysis.hf_check --torch_python=PY)
  hf_checker.py      hf_check's runs: the transformers child, every family checked, the report
  hf_compare.py      hf_check's engine side: one checkpoint loaded, measured and compared
  hf_reference.py    the transformers side of hf_check, a child process (not imported)
  tokenizer_check.py the exported tokenizers against transformers' AutoTokenizer on a long text
                     (command: python -m engine.analysis.tokenizer_check --transformers_python=PY)
  tokenizer_compare.py  tokenizer_check's engine side: tokenizers trained, exports written, ids
                     compared, the report
  tokenizer_reference.py  the AutoTokenizer side of tokenizer_check, a child process (not
                     imported)
  transformers_output.py  what transformers says in those children, collected (not imported)
"""
