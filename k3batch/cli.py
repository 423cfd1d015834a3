"""The `k3batch` command line. Each command parses flags, builds typed config and calls one
library function."""

import click


@click.group()
def main():
    """k3batch: batch inference for the Kimi K3 model family on Ray."""


@main.command("init-checkpoint")
@click.option("--flavor", default="k3-debug", show_default=True, help="Named config (k3-debug, k3-slice, kimi-linear-debug, ...).")
@click.option("--seed", default=0, show_default=True, type=int)
@click.argument("out", type=click.Path(file_okay=False))
def init_checkpoint_cmd(flavor, seed, out):
    """Write a random-weight checkpoint in the official Hugging Face layout to OUT."""
    from k3batch.model.weights import init_checkpoint

    try:
        init_checkpoint(flavor, out, seed)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    click.echo(f"wrote {flavor} checkpoint (seed {seed}) to {out}")


@main.command()
@click.option("--model", "model_dir", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--prompt", "prompts", multiple=True, required=True, help="Repeat for several prompts.")
@click.option("--chat/--no-chat", default=False, help="Wrap each prompt as a user message in the chat template.")
@click.option("--max-new-tokens", default=32, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float)
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int)
@click.option("--seed", default=None, type=int)
@click.option("--ignore-eos", is_flag=True)
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
def generate(model_dir, prompts, chat, max_new_tokens, temperature, top_p, top_k, seed, ignore_eos, device):
    """Generate from PROMPTs on one device and print the completions."""
    from k3batch.engine.request import SamplingParams
    from k3batch.generate import generate_text

    try:
        sampling = SamplingParams(
            temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
            max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
        ).validate()  # fmt: skip
        outputs = generate_text(model_dir, list(prompts), sampling, chat=chat, device=device)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    for prompt, (text, res) in zip(prompts, outputs):
        click.echo(f"--- {prompt!r} -> [{res.finish_reason}, {len(res.output_token_ids)} tokens]")
        click.echo(text)
