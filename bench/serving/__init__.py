"""The parts of `python -m bench.serve` (bench/serve.py runs them in order; its docstring says
what each figure of the result is)."""
