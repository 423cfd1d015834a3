"""The Ray Data interface: `generate(ds, model=...)` runs k3batch on a `ray.data.Dataset` and
returns a Dataset of the same rows, each with the output columns of `k3batch run` appended.

How: `ds.map_batches` over a pool of `concurrency` actors (a fixed count, or (min, max) for Ray
Data to scale), each a `DataReplicaActor` holding one single-device engine, built once. A batch
is prepared row by row as a job's unit is (`prompts.prepare_rows`: the prompt source, the chat
template, per-row sampling columns), its rows go to the actor's engine, which steps
continuously over the rows of every batch in flight (the call is async, so Ray Data runs
several batches of an actor at once), and come back in input order. A bad row (no prompt, too
long, a bad sampling value) comes back with its `error` set, like the job's; a dataset without
a prompt column, or with a column named like an output column, and an engine failure raise.

What stays the job's (`k3batch run`): row ids, exactly-once output shards and resume, replica
restarts with row retries, elastic placement, and replicas spanning devices (pp, tp, dcp).
"""

import asyncio
import threading
from typing import TYPE_CHECKING

import pyarrow as pa

from k3batch.actors.build import build_engine
from k3batch.actors.placement import freeze_start_up
from k3batch.actors.serve import EngineServer
from k3batch.driver.inputs import file_contract
from k3batch.engine.config import EngineConfig
from k3batch.engine.request import SamplingParams
from k3batch.driver.jobspec import InputSpec, JobSpec, OutputSpec, ReplicaRange, ReplicaSpec
from k3batch.driver.prompts import prepare_rows
from k3batch.actors.result import append_results, error_row, result_names, result_row

if TYPE_CHECKING:
    import ray.data

DATASET = "<ray.data.Dataset>"  # the input and output "path" of the spec a Dataset runs under


def generate(
    ds: "ray.data.Dataset",
    *,
    model: str,
    sampling: SamplingParams | None = None,
    engine: EngineConfig | None = None,
    concurrency: int | tuple[int, int] = 1,
    batch_size: int = 64,
    device: str = "auto",
    num_gpus: float | None = None,
    accelerator_type: str | None = None,
    logprobs: bool = False,
    prompt_logprobs: bool = False,
    input_columns: InputSpec | None = None,
) -> "ray.data.Dataset":
    """`ds` with the output columns of `k3batch run` appended to every row (lazy, like any
    Ray Data transform). Settings are a job's (`driver/jobspec.py`) and checked the same way, with a
    ValueError naming the field, before anything runs.

    model: checkpoint directory; sampling: every row's defaults (a row's own `temperature`,
    `max_new_tokens`, ... columns override them); engine: each replica's engine settings;
    concurrency: replicas, N or (min, max); batch_size: rows per call of a replica; device:
    "cpu", "cuda" or "auto" (cuda iff `num_gpus` or `accelerator_type` asks for GPUs); num_gpus:
    per replica (default 1 on cuda); logprobs / prompt_logprobs: add those columns;
    input_columns: the prompt column names (`prompt_column`, `messages_column`,
    `token_ids_column`; its other fields are not used). Output columns: generated_text,
    output_token_ids, finish_reason, num_prompt_tokens, num_output_tokens, error, and the
    log-probability columns asked for.
    """
    spec = _spec(model, sampling, engine, concurrency, device, num_gpus, accelerator_type,
                 logprobs, prompt_logprobs, input_columns)  # fmt: skip
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size = {batch_size!r} must be an integer >= 1")
    r = spec.replicas
    if r.resolved_device == "cuda":
        resources = {"num_gpus": r.num_gpus or 1, "accelerator_type": r.accelerator_type}
    else:
        resources = {"num_cpus": 1}  # build_engine runs one torch thread on CPU
    return _map(ds, spec, batch_size, resources, DataReplicaActor)


def _map(ds, spec: JobSpec, batch_size: int, resources: dict, actor_cls) -> "ray.data.Dataset":
    """`ds.map_batches` over a pool of `actor_cls` replicas. Failures end the pipeline with
    their cause instead of looping: a constructor's error at once (Ray Data's budget of actor
    deaths at start-up is 0 by default), an engine's error at the call, and a replica process
    that dies is restarted and its batch retried at most `replicas.max_consecutive_failures`
    times (Ray Data's defaults are unbounded: a replica that crashes the same way every time
    would hold the pipeline forever)."""
    r = spec.replicas
    pool = r.num_replicas if isinstance(r.num_replicas, int) else (r.min_replicas, r.max_replicas)
    return ds.map_batches(
        actor_cls,
        fn_constructor_kwargs={"spec": spec},
        concurrency=pool,
        batch_size=batch_size,
        batch_format="pyarrow",
        udf_modifying_row_count=False,  # one output row per input row
        # Ray 2.60 names no parameter for these and warns that the pass-through is deprecated
        max_restarts=r.max_consecutive_failures,
        max_task_retries=r.max_consecutive_failures,
        **resources,
    )


def _spec(model, sampling, engine, concurrency, device, num_gpus, accelerator_type, logprobs,
          prompt_logprobs, input_columns) -> JobSpec:  # fmt: skip
    """The job spec a Dataset runs under (input and output are the Dataset), validated."""
    if isinstance(concurrency, tuple | list):
        if len(concurrency) != 2:
            raise ValueError(f"concurrency = {concurrency!r}: expected N or (min, max)")
        concurrency = ReplicaRange(min=concurrency[0], max=concurrency[1])
    columns = input_columns or InputSpec()
    spec = JobSpec(
        model=model,
        name="ray-data",
        input=InputSpec(
            path=DATASET,
            prompt_column=columns.prompt_column,
            messages_column=columns.messages_column,
            token_ids_column=columns.token_ids_column,
        ),
        output=OutputSpec(path=DATASET, logprobs=logprobs, prompt_logprobs=prompt_logprobs),
        sampling=sampling or SamplingParams(),
        engine=engine or EngineConfig(),
        replicas=ReplicaSpec(num_replicas=concurrency, device=device, num_gpus=num_gpus,
                             accelerator_type=accelerator_type),  # fmt: skip
    )
    return spec.validate()


class DataReplicaActor:
    """One replica of `generate`'s actor pool (Ray Data constructs it in each actor): a
    single-device engine stepped by its own thread (`actors.serve.EngineServer`), and an async
    call per batch of rows (a `pyarrow.Table`) that returns the batch with the output columns
    appended, row for row. The call is a coroutine, so Ray Data runs several batches of an
    actor at once and their rows share the engine's batch: one batch's last rows run beside the
    next batch's first ones. An engine failure fails every call then and after."""

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.engine, self.tokenizer = build_engine(
            spec.model, spec.engine, device=spec.replicas.resolved_device
        )
        out = spec.output
        self.names = result_names(logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs)
        self.failure: BaseException | None = None
        self.pending: set = set()  # futures of rows in the engine
        self.lock = threading.Lock()  # failure and pending: the engine thread and the calls
        freeze_start_up()
        self.server = EngineServer(self.engine, self._finished, self._failed)

    async def __call__(self, batch: pa.Table) -> pa.Table:
        file_contract(batch.schema, self.spec.input)  # a prompt column, no output-column clash
        works = prepare_rows(
            batch,
            spec=self.spec.input,
            model_dir=self.spec.model,
            defaults=self.spec.row_defaults,
            max_seq_len=self.spec.engine.max_seq_len,
            vocab_size=self.engine.vocab_size,
        )
        assert [w.row_idx for w in works] == list(range(batch.num_rows))  # one work per row
        todo = [w for w in works if w.error is None]
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in todo]
        with self.lock:  # either the failure settles these futures, or this call sees it
            if self.failure is not None:
                raise RuntimeError("the replica's engine failed") from self.failure
            self.pending.update(futures)
            self.server.submit(((fut, loop), w.prompt_token_ids, w.sampling)
                               for fut, w in zip(futures, todo))  # fmt: skip
        done = await asyncio.gather(*futures)
        results = [error_row(w.error) if w.error else None for w in works]
        for w, res in zip(todo, done):
            results[w.row_idx] = result_row(res, self.tokenizer)
        return append_results(batch, results, self.names)

    # ---- called on the engine thread --------------------------------------------------------
    def _finished(self, key, res) -> None:
        fut, loop = key
        loop.call_soon_threadsafe(self._settle, fut, res, None)

    def _failed(self, error: BaseException) -> None:
        with self.lock:
            self.failure = error
            for fut in self.pending:
                fut.get_loop().call_soon_threadsafe(self._settle, fut, None, error)

    def _settle(self, fut, res, error) -> None:
        with self.lock:
            self.pending.discard(fut)
        if fut.done():
            return
        if error is None:
            fut.set_result(res)
        else:
            fut.set_exception(RuntimeError(f"the replica's engine failed: {error!r}"))
