"""The output columns of a row, one definition for every way k3batch returns rows: the batch
job's shards (`k3batch run`), the replica's answers and the Ray Data interface (`data.py`).

A finished row is a dict with the columns of `RESULT_TYPES` (`result_row` for an engine result,
`error_row` for a row that never ran); `append_results` adds the columns a caller asked for to
the input rows, typed as `RESULT_TYPES` says, so every batch of an output has one schema.
"""

import pyarrow as pa

from k3batch.engine.request import GenerationResult

RESULT_TYPES = {
    "generated_text": pa.string(),
    "output_token_ids": pa.list_(pa.int32()),
    "finish_reason": pa.string(),
    "num_prompt_tokens": pa.int32(),
    "num_output_tokens": pa.int32(),
    "error": pa.string(),
    "output_logprobs": pa.list_(pa.float32()),
    "prompt_logprobs": pa.list_(pa.float32()),
    "prompt_greedy": pa.list_(pa.bool_()),  # with prompt_logprobs: each token the argmax
}


def result_names(*, logprobs: bool, prompt_logprobs: bool) -> list[str]:
    """The output columns of a run: the log-probability columns only when asked for."""
    return [
        n
        for n in RESULT_TYPES
        if (n != "output_logprobs" or logprobs)
        and (n not in ("prompt_logprobs", "prompt_greedy") or prompt_logprobs)
    ]


def result_row(res: GenerationResult, tokenizer) -> dict:
    """The output row of a finished request (failed or not); `tokenizer` decodes its text."""
    row = {
        "generated_text": None if res.error else tokenizer.decode(res.output_token_ids),
        "output_token_ids": res.output_token_ids,
        "finish_reason": res.finish_reason,
        "num_prompt_tokens": len(res.prompt_token_ids),
        "num_output_tokens": len(res.output_token_ids),
        "error": res.error,
    }
    if res.output_logprobs is not None:
        row["output_logprobs"] = res.output_logprobs
    if res.prompt_logprobs is not None:
        row["prompt_logprobs"] = res.prompt_logprobs
        row["prompt_greedy"] = res.prompt_greedy
    return row


def error_row(message: str) -> dict:
    """The output row of a row that failed before or instead of running."""
    return {
        "generated_text": None,
        "output_token_ids": None,
        "finish_reason": "error",
        "num_prompt_tokens": None,
        "num_output_tokens": 0,
        "error": message,
    }


def append_results(table: pa.Table, results: list[dict], names: list[str]) -> pa.Table:
    """`table` (the input rows) with the columns `names` of `results` (one dict per row, in
    row order) appended; a column a row lacks is null there."""
    assert len(results) == table.num_rows, (len(results), table.num_rows)
    for name in names:
        values = [r.get(name) for r in results]
        table = table.append_column(name, pa.array(values, RESULT_TYPES[name]))
    return table
