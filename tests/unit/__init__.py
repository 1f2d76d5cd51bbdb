"""One module or function against NumPy, a hand-worked value or hand-written input."""
