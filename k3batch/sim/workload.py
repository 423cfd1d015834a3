"""What a job asks of the engine, for the estimate: how many prompts, how long they are and how
many tokens each generates.

`Workload.fixed(n, input_len, output_len)` is the benchmarks' workload (every prompt the same,
EOS ignored). `workload_from_job(spec, sample_rows)` reads a job's own input: it lists the
files as the job would (`io.resolve.resolve_input`), counts their rows, and tokenizes the first
`sample_rows` rows through the job's row preparation (`driver.prompts.prepare_rows`: the same
prompt columns, chat template and per-row `max_new_tokens`), so the lengths are the job's. A
request's output length is its `max_new_tokens`: where the model stops early at EOS the job
finishes sooner than estimated (an upper bound, stated in the estimate). Rows that the job
would fail (bad ids, too long) are counted apart and cost nothing.
"""

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    num_prompts: int  # rows of the whole job
    prompt_lens: tuple[int, ...]  # a sample, cycled over the simulated requests
    output_lens: tuple[int, ...]  # same length as prompt_lens
    source: str  # where the lengths come from (printed with the estimate)
    bad_rows: int = 0  # of the sample: rows the job would fail without computing

    def __post_init__(self):
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts = {self.num_prompts} must be >= 1")
        if not self.prompt_lens or len(self.prompt_lens) != len(self.output_lens):
            raise ValueError("a workload needs as many prompt lengths as output lengths, >= 1")
        if min(self.prompt_lens) < 1 or min(self.output_lens) < 1:
            raise ValueError("prompt and output lengths must be >= 1")

    @classmethod
    def fixed(cls, num_prompts: int, input_len: int, output_len: int) -> "Workload":
        return cls(num_prompts=num_prompts, prompt_lens=(input_len,), output_lens=(output_len,),
                   source=f"{num_prompts:,} prompts of {input_len:,} in / {output_len:,} out")  # fmt: skip

    @property
    def mean_input(self) -> float:
        return sum(self.prompt_lens) / len(self.prompt_lens)

    @property
    def mean_output(self) -> float:
        return sum(self.output_lens) / len(self.output_lens)

    @property
    def max_seq_len(self) -> int:
        return max(p + o for p, o in zip(self.prompt_lens, self.output_lens)) + 1

    def sample(self, n: int) -> list[tuple[int, int]]:
        """n (prompt_len, output_len) pairs, cycling through the sample in order."""
        k = len(self.prompt_lens)
        return [(self.prompt_lens[i % k], self.output_lens[i % k]) for i in range(n)]

    def total_output_tokens(self) -> float:
        return self.num_prompts * self.mean_output

    def scaled(self, num_prompts: int) -> "Workload":
        return dataclasses.replace(self, num_prompts=num_prompts)


def workload_from_job(spec, *, sample_rows: int = 2000) -> Workload:
    """The lengths of a job spec's (`driver.jobspec.JobSpec`) first `sample_rows` rows, as the
    job tokenizes them, and its total row count. Raises ValueError when no row can run."""
    from k3batch.driver.prompts import prepare_rows
    from k3batch.io.resolve import resolve_input
    from k3batch.io.source import count_rows, iter_units
    from k3batch.model.config import K3Config

    fs, files = resolve_input(spec.input.path, spec.input.format)
    counts = count_rows(fs, files)
    total = sum(n or 0 for n in counts)
    vocab = K3Config.from_hf(spec.model).vocab_size
    prompt, output, bad = [], [], 0
    for unit in iter_units(fs, files, min(sample_rows, 4096)):
        if unit.table is None:
            continue
        rows = prepare_rows(unit.table, spec=spec.input, model_dir=spec.model,
                            defaults=spec.sampling, max_seq_len=spec.engine.max_seq_len,
                            vocab_size=vocab)  # fmt: skip
        for row in rows:
            if row.error is not None:
                bad += 1
            else:
                prompt.append(len(row.prompt_token_ids))
                output.append(row.sampling.max_new_tokens)
        if len(prompt) + bad >= sample_rows:
            break
    if not prompt:
        raise ValueError(f"input {spec.input.path!r}: no row of the first {sample_rows} can run")
    n = len(prompt) + bad
    return Workload(num_prompts=total, prompt_lens=tuple(prompt), output_lens=tuple(output),
                    bad_rows=bad,
                    source=f"{spec.input.path}: {total:,} rows; lengths of the first {n:,} "
                           f"as the job tokenizes them ({bad} would fail)")  # fmt: skip
