import dataclasses
import json

import pytest

from k3batch.engine.config import EngineConfig
from k3batch.driver.jobspec import InputSpec, JobSpec, OutputSpec, ReplicaSpec
from k3batch.model import get_flavor
from k3batch.model.weights import init_checkpoint, write_checkpoint
from k3batch.tokenizer import Tokenizer

WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "river", "stone"]


@pytest.fixture(scope="session")
def shallow_ckpt(tmp_path_factory):
    """k3-debug's widths with 4 layers (3 KDA, 1 MLA): the job and backend tests' model."""
    config = dataclasses.replace(get_flavor("k3-debug"), num_hidden_layers=4, kda_layers=(1, 2, 3),
                                 full_attn_layers=(4,), experts_mxfp4=True)  # fmt: skip
    path = tmp_path_factory.mktemp("ckpt") / "k3-shallow"
    write_checkpoint(config.validate(), path, seed=0)
    return str(path)


@pytest.fixture(scope="session")
def tok(tmp_path_factory):
    """k3-debug's tokenizer: what request building needs, without a model."""
    path = tmp_path_factory.mktemp("tok")
    init_checkpoint("k3-debug", path, seed=0)
    return Tokenizer.from_dir(path)


def eval_job(model: str, out, name: str, *, replicas: int = 1, **engine) -> JobSpec:
    """The model, resources and engine settings of an eval (its input and sampling are the
    eval's own). One sequence per forward by default: bit-exact per-row arithmetic."""
    engine = {"max_num_seqs": 1, "max_seq_len": 256, "chunk_size": 128, "page_size": 64} | engine
    return JobSpec(
        model=model, name=name, input=InputSpec(batch_rows=8), output=OutputSpec(path=str(out)),
        replicas=ReplicaSpec(num_replicas=replicas, device="cpu", max_inflight_rows=32),
        engine=EngineConfig(**engine),
    )  # fmt: skip


def write_mc_suite(folder, num_items: int, *, num_fewshot: int = 2, seed: int = 1) -> str:
    """A made-up 4-choice suite: items.jsonl, dev.jsonl (few-shot) and suite.yaml in folder."""
    import random

    rng = random.Random(seed)

    def items(n):
        return [{"question": f"Which word follows {rng.choice(WORDS)} {rng.choice(WORDS)}?",
                 "choices": rng.sample(WORDS, 4), "answer": rng.randrange(4)}
                for _ in range(n)]  # fmt: skip

    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("items", items(num_items)), ("dev", items(max(num_fewshot, 1)))):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "suite.yaml").write_text(
        "name: mc\nkind: multiple_choice\ndata: items.jsonl\nfewshot_data: dev.jsonl\n"
        f"num_fewshot: {num_fewshot}\n"
        "prompt: \"Question: {{ question }}\\nAnswer:\"\nchoices: choices\ngold: answer\n"
    )
    return str(folder / "suite.yaml")


@pytest.fixture
def make_job():
    return eval_job


@pytest.fixture
def make_mc_suite():
    return write_mc_suite
