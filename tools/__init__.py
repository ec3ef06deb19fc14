"""Development tools: the model builders of the tests and bench (a factory of tiny checkpoints per
architecture, the zoo of every causal LM type transformers knows) and the scripts that rebuild the
bundled models. They live in the repository, not in the installed package (pyproject's `packages`
leave them out): `python -m fp8kv.tools.train` from a checkout.
"""
