"""An lm-evaluation-harness backend: `K3LM`, a `TemplateLM` whose requests run as k3batch batch
jobs on Ray. Needs the optional extra (`pip install k3batch[eval]`).

    lm = K3LM(job)                        # job: model, output dir, replicas, engine, address
    lm_eval.simple_evaluate(model=lm, tasks=["arc_challenge"])

Each call (`loglikelihood`, `loglikelihood_rolling`, `generate_until`) is one batch job in
its own folder under job.output.path, named by the call's kind and a hash of its requests: a
rerun of the same evaluation finds the shards an interrupted run committed and runs only the
rest. Requests are built as `k3batch eval` builds them (`requests.py`: the same tokenization,
the same rolling windows), so the two give the same log-likelihoods. Contexts longer than the
model's window keep their last tokens. `generate_until` honours `until` (the engine stops at the
first token whose text completes a stop string, and the text is cut before it) and
`max_gen_toks`; `do_sample` / `temperature` pick the sampling.
"""

import hashlib
from pathlib import Path

import pyarrow as pa
from lm_eval.api.model import TemplateLM

from k3batch.eval.requests import SCHEMA, encode_pair, rolling_windows, sample_seed
from k3batch.eval.run import run_requests
from k3batch.eval.score import cut, scored
from k3batch.driver.jobspec import JobSpec
from k3batch.tokenizer import Tokenizer

DEFAULT_MAX_GEN_TOKS = 256


class K3LM(TemplateLM):
    def __init__(self, job: JobSpec, *, seed: int = 0):
        super().__init__()
        self.job, self.seed = job, seed
        self.tokenizer = Tokenizer.from_dir(job.model)
        self.max_length = job.engine.max_seq_len - 1  # the longest prompt the engine takes
        self.calls = 0  # batch jobs run (each call with requests is one)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_token_id

    @property
    def tokenizer_name(self) -> str:
        return str(Path(self.job.model).resolve())

    def tok_encode(self, string: str, add_special_tokens: bool = False, **kw) -> list[int]:
        return self.tokenizer.encode(string, add_bos=add_special_tokens)

    def _encode_pair(self, context: str, continuation: str):
        return encode_pair(self.tokenizer, context, continuation)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw):
        """requests: ((context, continuation), context ids, continuation ids) -> (log p, greedy)."""
        rows = []
        for i, (_, ctx, cont) in enumerate(requests):
            ids = (ctx + cont)[-self.max_length :]
            rows.append(_row(i, ids, start=len(ids) - len(cont)))
        out = [scored(r) for r in self._run("loglikelihood", rows)]
        answers = [(s["loglik"], s["is_greedy"]) for s in out]
        for (key, _, _), answer in zip(requests, answers):  # for lm-eval's use_cache
            self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        rows, owner = [], []
        for i, req in enumerate(requests):
            (text,) = req.args
            ids = self.tokenizer.encode(text, add_bos=True)
            for prompt, start in rolling_windows(ids, self.max_length):
                rows.append(_row(len(rows), prompt, start=start))
                owner.append(i)
        out = self._run("loglikelihood_rolling", rows)
        totals = [0.0] * len(requests)
        for i, r in zip(owner, out):
            totals[i] += scored(r)["loglik"]
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        rows, untils = [], []
        for i, req in enumerate(requests):
            context, kwargs = req.args
            kwargs = dict(kwargs)
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_gen = int(kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            temperature = float(kwargs.pop("temperature", 0.0)) if kwargs.pop("do_sample", False) \
                else 0.0  # fmt: skip
            ids = self.tokenizer.encode(context, add_bos=True)
            ids = ids[-max(self.max_length - max_gen, 1) :]  # room for the completion
            seed = sample_seed(self.seed, "", i, 0)
            rows.append(_row(i, ids, start=len(ids), max_new_tokens=max_gen,
                             temperature=temperature, seed=seed, stop=until or None))  # fmt: skip
            untils.append(until)
        out = self._run("generate_until", rows)
        texts = [cut(r["generated_text"], u) for r, u in zip(out, untils)]
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    def _run(self, kind: str, rows: list[dict]) -> list[dict]:
        """One batch job for `rows`; their output rows in order. RuntimeError naming the first
        failed row (lm-eval has no per-request error)."""
        if not rows:
            return []
        table = pa.Table.from_pylist(rows, schema=SCHEMA)
        digest = hashlib.sha256(repr(rows).encode())
        out = Path(self.job.output.path) / f"{kind}-{digest.hexdigest()[:12]}"
        self.calls += 1
        got, report = run_requests(table, out, self.job)
        bad = [(r["id"], g and g["error"]) for r, g in zip(rows, got) if g is None or g["error"]]
        if bad:
            raise RuntimeError(f"{len(bad)} of {len(rows)} {kind} requests failed, first {bad[0]}"
                               f" (output in {out})")  # fmt: skip
        return got


def _row(i: int, ids: list[int], *, start: int, max_new_tokens: int = 1, temperature: float = 0.0,
         seed: int | None = None, stop: list[str] | None = None) -> dict:  # fmt: skip
    return {"id": f"{i:09d}", "task": "lm-eval", "item": i, "sub": 0, "prompt_token_ids": ids,
            "prompt_logprobs_start": start, "max_new_tokens": max_new_tokens,
            "temperature": temperature, "seed": seed, "stop": stop}  # fmt: skip


def write_lm_eval_results(results: dict, out: str) -> str:
    """Save lm-eval's results dict as results.json under `out`; lm-eval's table of them."""
    import json

    from lm_eval.utils import make_table

    Path(out, "results.json").write_text(json.dumps(results, indent=1, sort_keys=True, default=str))
    return make_table(results)


def run_lm_eval(tasks: list[str], job: JobSpec, *, include_path: str | None = None,
                num_fewshot: int | None = None, limit: int | None = None,
                seed: int = 0) -> dict:  # fmt: skip
    """lm-eval's `simple_evaluate` with K3LM over lm-eval's task registry (plus the task YAMLs
    under include_path). Returns lm-eval's results dict."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_path)
    return lm_eval.simple_evaluate(
        model=K3LM(job, seed=seed), tasks=tasks, num_fewshot=num_fewshot, limit=limit,
        task_manager=manager, random_seed=seed, log_samples=False,
    )  # fmt: skip
