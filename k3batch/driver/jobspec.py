"""JobSpec: what a batch job reads, how it generates, where it writes, on what resources.

A spec is a TOML or YAML file with the sections below (the common fields can also be set by CLI
flags, see `k3batch/cli/`); `validate()` checks everything that can be checked before any model is
loaded and raises `ValueError` naming the field. Example: `jobs/debug_cpu.toml`.

Types are checked strictly, by a pydantic schema derived from the dataclasses' annotations (the
dataclasses stay the one definition): `batch_rows = "4"`, `num_replicas = 1.5` or
`prefix_cache = 1` are refused with the field's name and the expected type or values; an int is
accepted where a float is expected, a list where a tuple is.

    model = "out/demo/model"            # checkpoint dir in the official HF layout
    [input]   path, format, batch_rows, id_column, prompt_column, messages_column,
              token_ids_column, served_model, strict_model
    [output]  path, format, merge, logprobs, prompt_logprobs
    [sampling] temperature, top_p, top_k, seed, max_new_tokens, stop_token_ids, stop, ignore_eos
    [replicas] num_replicas (N or {min, max}), pp, pp_layers, tp, dcp, disaggregate, device,
               num_gpus, accelerator_type, gpus_per_node, max_inflight_rows, max_retries,
               max_consecutive_failures, wait_timeout_s

A replica is one engine on one device (pp = tp = 1), or actors: pp prefill stages and, when
tp > 1 or `disaggregate = true`, a decode group of tp ranks that each finished prompt is handed
to. `disaggregate = true` with pp = tp = 1 is the smallest disaggregated replica: one prefill
stage on one GPU, one decode rank on another.
    [engine]  max_num_seqs, max_seq_len, chunk_size, max_batch_tokens, page_size, memory_pool,
              prefix_cache, cache_bytes, memory_fraction
"""

import dataclasses
import functools
import hashlib
import json
import operator
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import pydantic

from k3batch.engine.config import EngineConfig
from k3batch.engine.request import SamplingParams
from k3batch.model.config import K3Config

# Per-row sampling overrides: input columns with these names, when present, win over [sampling].
# prompt_logprobs_start: score only the prompt tokens from this position on (a continuation);
# stop: a list of stop strings.
ROW_SAMPLING_COLUMNS = (
    "temperature", "top_p", "top_k", "seed", "max_new_tokens", "prompt_logprobs_start", "stop",
)


INPUT_FORMATS = ("auto", "parquet", "jsonl", "csv", "arrow", "hf", "openai")  # io.resolve.FORMATS
OUTPUT_FORMATS = ("parquet", "jsonl", "openai")


@dataclass(frozen=True, kw_only=True, slots=True)
class InputSpec:
    path: str = ""  # file, directory, glob or URI (pyarrow.fs)
    # auto: by extension (.parquet, .jsonl[.gz], .json, .csv[.gz], .arrow/.feather/.ipc, a
    # save_to_disk folder); "openai": OpenAI Batch API request lines; "hf": a save_to_disk folder
    format: str = "auto"
    batch_rows: int = 256  # rows per unit of work and per output shard
    id_column: str = "id"  # optional; else ids are "<file>:<row>"
    prompt_column: str = "prompt"  # text
    messages_column: str = "messages"  # chat: list of {role, content}
    token_ids_column: str = "prompt_token_ids"  # pre-tokenized
    served_model: str = ""  # openai: the model name requests must give; "": the model dir's name
    strict_model: bool = False  # openai: another model name is the row's error, not a warning


@dataclass(frozen=True, kw_only=True, slots=True)
class OutputSpec:
    path: str = ""  # directory or URI
    format: str = "parquet"  # parquet, jsonl or openai (OpenAI Batch API output lines)
    merge: bool = False  # once every row has its output: also one file of all shards, in order
    logprobs: bool = False
    prompt_logprobs: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaRange:
    """An elastic replica count: the job starts with `min` replicas up and grows to `max` as
    resources appear (TOML: `num_replicas = {min = 1, max = 8}`)."""

    min: int
    max: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaSpec:
    num_replicas: int | ReplicaRange = 1  # a fixed count, or {min, max}: elastic
    pp: int = 1  # pipeline-parallel prefill stages
    pp_layers: tuple[int, ...] | None = None  # layers per stage; default: whole AttnRes blocks
    tp: int = 1  # tensor-parallel decode ranks
    dcp: int = 1  # decode context parallelism for the MLA latent
    disaggregate: bool = False  # a decode group apart from prefill also at tp = 1 (tp > 1: always)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda iff the spec asks for GPUs
    num_gpus: float | None = None  # of a single-device replica (stages and ranks take 1 each)
    accelerator_type: str | None = None  # e.g. "H200": lets the autoscaler pick node types
    gpus_per_node: int = 8  # of the GPU nodes: a replica needing more spans nodes (PACK)
    max_inflight_rows: int = 0  # rows dispatched to one replica and not yet returned; 0: twice
    # the engine's max_num_seqs, at least 64 (`JobSpec.inflight_rows`)
    max_retries: int = 3  # per row lost to a replica's own failure (node loss is not counted)
    # a replica that fails this many times in a row (at start-up, or with no row finished since
    # its last failure) stops the job with its cause: a crash loop, not a retry
    max_consecutive_failures: int = 3
    wait_timeout_s: float = 600.0  # for resources, replicas to come up, a replica to come back

    def __post_init__(self):
        if isinstance(self.num_replicas, dict):  # from a checked spec dict
            object.__setattr__(self, "num_replicas", ReplicaRange(**self.num_replicas))

    @property
    def min_replicas(self) -> int:
        n = self.num_replicas
        return n.min if isinstance(n, ReplicaRange) else n

    @property
    def max_replicas(self) -> int:
        n = self.num_replicas
        return n.max if isinstance(n, ReplicaRange) else n

    @property
    def has_decode_group(self) -> bool:
        return self.tp > 1 or self.disaggregate

    @property
    def is_single_device(self) -> bool:
        """One engine in the replica actor's process: no stage or rank actors."""
        return self.pp == 1 and not self.has_decode_group

    @property
    def num_workers(self) -> int:
        """Stage and rank actors of a replica (one device each on cuda); 0: single device."""
        return 0 if self.is_single_device else self.pp + (self.tp if self.has_decode_group else 0)

    @property
    def resolved_device(self) -> str:
        """The device from the spec alone, never from the GPUs the cluster has now (a cluster
        scaled to zero has none): "auto" is "cuda" when the job asks for GPUs (an
        `accelerator_type`, or `num_gpus` > 0), else "cpu"."""
        if self.device != "auto":
            return self.device
        return "cuda" if self.accelerator_type or (self.num_gpus or 0) > 0 else "cpu"


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSpec:
    model: str = ""
    name: str = "k3batch-job"
    address: str | None = None  # Ray cluster; None: a local Ray started for the job
    metrics: bool = True  # export k3batch_* metrics through Ray's metrics agent (Prometheus)
    input: InputSpec = field(default_factory=InputSpec)
    output: OutputSpec = field(default_factory=OutputSpec)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    replicas: ReplicaSpec = field(default_factory=ReplicaSpec)
    engine: EngineConfig = field(default_factory=EngineConfig)

    @property
    def inflight_rows(self) -> int:
        """Rows in flight per replica: max_inflight_rows, or twice the engine's max_num_seqs
        (where the engine sizes it: its most on a GPU, MAX_AUTO_SEQS), at least 64, so that
        the engine's batch stays full while finished rows travel back."""
        if self.replicas.max_inflight_rows:
            return self.replicas.max_inflight_rows
        from k3batch.engine.config import CPU_MAX_NUM_SEQS
        from k3batch.engine.runner import MAX_AUTO_SEQS

        auto = MAX_AUTO_SEQS if self.replicas.resolved_device == "cuda" else CPU_MAX_NUM_SEQS
        return max(64, 2 * (self.engine.max_num_seqs or auto))

    def validate(self) -> "JobSpec":
        """Checks that need no cluster and no model weights: types first, then values."""
        check_types(dataclasses.asdict(self), source="job spec")
        if not self.model:
            raise ValueError("model: no checkpoint directory given")
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model: {self.model!r} has no config.json")
        if not self.input.path:
            raise ValueError("input.path: no input given")
        if not self.output.path:
            raise ValueError("output.path: no output given")
        if self.input.format not in INPUT_FORMATS:
            raise ValueError(f"input.format = {self.input.format!r} must be one of "
                             f"{', '.join(INPUT_FORMATS)}")  # fmt: skip
        if self.output.format not in OUTPUT_FORMATS:
            raise ValueError(f"output.format = {self.output.format!r} must be one of "
                             f"{', '.join(OUTPUT_FORMATS)}")  # fmt: skip
        if self.input.format == "openai":
            for name in ("id_column", "prompt_column", "messages_column", "token_ids_column"):
                default = getattr(InputSpec(), name)
                if getattr(self.input, name) != default:
                    raise ValueError(f"input.{name} = {getattr(self.input, name)!r}: OpenAI "
                                     f"input has fixed columns (leave it {default!r})")  # fmt: skip
        if self.input.batch_rows < 1:
            raise ValueError(f"input.batch_rows = {self.input.batch_rows} must be >= 1")
        _prefixed("sampling", self.sampling.validate)
        _prefixed("engine", self.engine.validate)
        r = self.replicas
        for name in ("min_replicas", "max_replicas", "pp", "tp", "dcp", "gpus_per_node"):
            if getattr(r, name) < 1:
                raise ValueError(f"replicas.{name} = {getattr(r, name)} must be >= 1")
        if r.max_inflight_rows < 0:
            raise ValueError(f"replicas.max_inflight_rows = {r.max_inflight_rows} must be >= 1, "
                             "or 0: twice the engine's max_num_seqs")  # fmt: skip
        if r.min_replicas > r.max_replicas:
            raise ValueError(
                f"replicas.num_replicas: min = {r.min_replicas} > max = {r.max_replicas}"
            )
        if r.device == "cpu" and (r.accelerator_type or (r.num_gpus or 0) > 0):
            raise ValueError(
                f"replicas.device = 'cpu' with accelerator_type = {r.accelerator_type!r}, "
                f"num_gpus = {r.num_gpus}: a CPU job asks for no GPUs"
            )
        if r.max_retries < 0:
            raise ValueError(f"replicas.max_retries = {r.max_retries} must be >= 0")
        if r.max_consecutive_failures < 1:
            raise ValueError(f"replicas.max_consecutive_failures = {r.max_consecutive_failures} "
                             "must be >= 1")  # fmt: skip
        if not r.wait_timeout_s > 0:
            raise ValueError(f"replicas.wait_timeout_s = {r.wait_timeout_s} must be > 0")
        cfg = K3Config.from_hf(self.model)
        from k3batch.parallel.layout import ParallelLayout, split_layers  # torch-free

        _prefixed("replicas", lambda: ParallelLayout(tp_size=r.tp, dcp_size=r.dcp).validate(cfg))
        _prefixed(
            "replicas",
            lambda: split_layers(cfg.num_hidden_layers, r.pp, cfg.attn_res_block_size, r.pp_layers),
        )
        return self

    @property
    def row_defaults(self) -> SamplingParams:
        """The sampling each row starts from (its own sampling columns override it): [sampling]
        with the log-probabilities that [output] asks for."""
        out = self.output
        return dataclasses.replace(
            self.sampling, logprobs=out.logprobs, prompt_logprobs=out.prompt_logprobs
        )

    def fingerprint(self) -> tuple[str, dict]:
        """What decides the job's results (not where or how fast it runs): the hash and the
        readable description stored in the output manifest."""
        desc = {
            "model": str(Path(self.model).resolve()),
            "input": dataclasses.asdict(self.input) | {"batch_rows": None},
            "output": {
                "logprobs": self.output.logprobs,
                "prompt_logprobs": self.output.prompt_logprobs,
            },
            "sampling": dataclasses.asdict(self.sampling),
            "max_seq_len": self.engine.max_seq_len,
        }
        # Fields added with formats count only when set, so older jobs keep their fingerprint.
        for key, default in (("format", "auto"), ("served_model", ""), ("strict_model", False)):
            if desc["input"][key] == default:
                del desc["input"][key]
        if self.output.format != "parquet":
            desc["output"]["format"] = self.output.format
        blob = json.dumps(desc, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16], desc


def _prefixed(section: str, check) -> None:
    try:
        check()
    except ValueError as e:
        raise ValueError(f"{section}.{e}") from None


_SECTIONS = {
    "input": InputSpec,
    "output": OutputSpec,
    "sampling": SamplingParams,
    "replicas": ReplicaSpec,
    "engine": EngineConfig,
}


def job_spec_from_dict(raw: dict, *, source: str = "job spec") -> JobSpec:
    """Build a JobSpec from nested dicts, rejecting unknown keys and wrong types by name."""
    top = {f.name for f in dataclasses.fields(JobSpec)}
    for key, value in raw.items():
        if key not in top:
            raise ValueError(f"{source}: unknown field {key!r}; known: {', '.join(sorted(top))}")
        if key in _SECTIONS:
            if not isinstance(value, dict):
                raise ValueError(f"{source}: [{key}] must be a table of fields")
            known = {f.name for f in dataclasses.fields(_SECTIONS[key])}
            for k in value:
                if k not in known:
                    raise ValueError(
                        f"{source}: unknown field {key}.{k}; known: {', '.join(sorted(known))}"
                    )
    checked = check_types(raw, source=source).model_dump(exclude_unset=True)
    kw = {k: _SECTIONS[k](**v) if k in _SECTIONS else v for k, v in checked.items()}
    return JobSpec(**kw)


def check_types(raw: dict, *, source: str = "job spec", cls=None) -> pydantic.BaseModel:
    """Check every field of a nested dict against the annotations of dataclass `cls` (default
    JobSpec); the checked model (lists become tuples where a tuple is declared). ValueError lists
    each bad field with its value."""
    try:
        return _schema(cls or JobSpec).model_validate(raw)
    except pydantic.ValidationError as e:
        bad: dict[str, list[str]] = {}  # one entry per field: a union's branches are joined
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"] if p not in _UNION_TAGS)
            value = err.get("input")
            bad.setdefault(f"{loc} = {value!r} ({type(value).__name__})", []).append(err["msg"])
        msg = "; ".join(f"{k}: {' or '.join(v)}" for k, v in bad.items())
        raise ValueError(f"{source}: {msg}") from None


_UNION_TAGS = {"int", "ReplicaRange"}  # pydantic names the branch of a union in the location


_STRICT = pydantic.ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


@functools.cache
def _schema(cls) -> type[pydantic.BaseModel]:
    """A strict pydantic model with the fields, annotations and defaults of dataclass `cls`."""
    fields = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = pydantic.Field(default_factory=f.default_factory)
        else:
            default = ...  # required
        fields[f.name] = (_strict(typing.get_type_hints(cls)[f.name]), default)
    return pydantic.create_model(cls.__name__, __config__=_STRICT, **fields)


def _strict(ann):
    """Nested dataclasses become their schema; a tuple also takes a list (TOML, YAML and JSON have
    no tuples), its items staying strict."""
    if dataclasses.is_dataclass(ann):
        return _schema(ann)
    args = typing.get_args(ann)
    if typing.get_origin(ann) is tuple:
        return Annotated[tuple[tuple(_strict(a) for a in args)], pydantic.Strict(False)]
    if isinstance(ann, types.UnionType):
        return functools.reduce(operator.or_, (_strict(a) for a in args))
    return ann


def load_job_spec(path: str | Path) -> JobSpec:
    """Read a .toml, .yaml or .yml job spec. Relative model/input/output paths are kept as
    written (relative to the working directory of the run)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"job spec {str(path)!r} does not exist")
    text = path.read_text()
    if path.suffix == ".toml":
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: {e}") from None
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: {e}") from None
    else:
        raise ValueError(f"job spec {str(path)!r}: expected a .toml, .yaml or .yml file")
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the top level must be a table of fields")
    return job_spec_from_dict(raw, source=str(path))


def with_overrides(spec: JobSpec, overrides: dict[str, object]) -> JobSpec:
    """Apply dotted-key overrides ("sampling.temperature": 0.7); None values are ignored."""
    for key, value in overrides.items():
        if value is None:
            continue
        section, _, name = key.rpartition(".")
        if section:
            sub = dataclasses.replace(getattr(spec, section), **{name: value})
            spec = dataclasses.replace(spec, **{section: sub})
        else:
            spec = dataclasses.replace(spec, **{name: value})
    return spec
