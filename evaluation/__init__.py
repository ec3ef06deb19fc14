"""Task accuracy on fp8kv's runtime: the lm-evaluation-harness model `fp8kv` and the `fp8kv eval` comparison.

`import fp8kv.evaluation.harness` registers the model with lm_eval (lm_eval 0.4 finds models only
through its registry, so the import is what makes `--model fp8kv` known); `python -m fp8kv.evaluation`
is lm_eval's command line with it registered. Needs the `eval` extra: `pip install "fp8kv[eval]"`.
"""
