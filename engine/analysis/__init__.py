"""What a compiled step does and what it should do: the library that engine.bench, engine.plan
and the analysis commands below measure and explain with. The core (engine/*, models/,
parallel/, train/, ...) never imports it.

  reference.py       the single-device computation every layout must reproduce
  hlo.py             readers of compiled HLO: loop trip counts (TPU records none), matmul types
  collectives.py     the collectives of a compiled step by kind and mesh axes, with their bytes
  comm_theory.py     the bytes a layout should move, from the model's spec and the rules
  slices.py          that theory as a step over several slices runs it (its data-centre share)
  verdicts.py        measured bytes beside the theory, and which rows are off it and why
  benchmark.py       step time, FLOP/s, memory and collectives of modes x meshes, interleaved
                     in one run (the library of python -m engine.bench)

The commands, each a package whose __main__.py is the command (`python -m engine.analysis.X`):

  compare/           auto against manual against the reference: numerics, speed, memory, bytes
  show_layout/       where every parameter and the batch live on the mesh, printed and drawn
  bubble/            a pipeline's bubble, measured from step times at several micro-batch counts
  hf_check/          the engine against transformers itself on each Hugging Face family
  tokenizer_check/   the exported tokenizers against transformers' AutoTokenizer

and references/, the outside implementations those commands run as child processes under
another Python (PyTorch, transformers); the engine never imports them.
"""
