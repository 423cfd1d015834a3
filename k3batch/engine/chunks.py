"""Where a prompt's prefill chunks end, and which chunks go into one prefill batch.

A prompt is cut into chunks of at most `chunk_size` tokens, always ending at fixed cut points:
multiples of chunk_size and, with the prefix cache, the last page boundary before the prompt's
end (and, for a scored continuation, before the first row it needs), where the KDA state is
checkpointed. The points depend on the prompt alone, so a prefix hit computes exactly what a
miss does, and a batch's composition depends only on prompt progress, so one device and a
pipeline run the same batches.
"""


def chunk_cuts(prompt_len: int, chunk_size: int, page_size: int | None,
               score_start: int = 0) -> tuple[int, ...]:  # fmt: skip
    """Chunk ends of a prompt: multiples of chunk_size and, with the prefix cache (page_size
    given), the last page boundary before the prompt's end and (for a scored continuation)
    before the first row it needs, score_start - 1, so that its context is checkpointed for
    the next choice."""
    cuts = set(range(chunk_size, prompt_len, chunk_size))
    if page_size is not None:
        for end in (prompt_len, score_start):
            if 0 < (end - 1) // page_size * page_size < prompt_len:
                cuts.add((end - 1) // page_size * page_size)
    return tuple(sorted(cuts))


def plan_batch(reqs: list, max_tokens: int) -> list[tuple[object, int]]:
    """(request, tokens) of one prefill batch: each request's next chunk, up to its next cut
    or its prompt's end, in order, within max_tokens in all (the last one possibly cut short)."""
    plan, budget = [], max_tokens
    for r in reqs:
        start = r.num_computed
        stop = next((c for c in r.cuts if c > start), len(r.prompt_token_ids))
        n = min(stop - start, budget)
        if n > 0:
            plan.append((r, n))
            budget -= n
    return plan
