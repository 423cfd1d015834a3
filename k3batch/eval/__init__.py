"""Evaluation on benchmark suites: task YAMLs (`suite`), their requests as a batch job
(`requests`, `run`), the scoring pass (`score`) and an lm-evaluation-harness backend
(`harness`, optional extra `k3batch[eval]`). `k3batch eval` is the command."""

from k3batch.eval.run import EvalResult, run_eval
from k3batch.eval.suite import SuiteSpec, TaskSpec, load_suite

__all__ = ["EvalResult", "SuiteSpec", "TaskSpec", "load_suite", "run_eval"]
