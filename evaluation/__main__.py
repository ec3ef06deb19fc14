"""`python -m fp8kv.evaluation ARGS`: lm_eval's own command line, with the `fp8kv` model registered."""

from fp8kv.evaluation import harness  # noqa: F401  (registers --model fp8kv)
from lm_eval.__main__ import cli_evaluate

if __name__ == "__main__":
    cli_evaluate()
