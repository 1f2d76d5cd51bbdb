"""`python -m engine.analysis.show_layout`: how the state and a batch are laid out on the mesh.

  __main__.py  the command
  layout.py    every parameter's and the batch's placement, printed and drawn
"""
