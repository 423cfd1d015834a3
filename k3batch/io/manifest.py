"""The job manifest: what fixes the meaning of an output directory's shard names.

A shard name is (file index, batch index), so it only means something against the sorted input
file list and the batch size chosen at the job's first start. The manifest records both, with the
job's fingerprint, in `_k3batch_manifest.json` beside the shards. Contract of `open_manifest`: a
resumed job uses the recorded file list and batch size, never a fresh listing; an output directory
is never shared by two different jobs, nor adopted if it holds shards without a manifest.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from dataclasses import dataclass

from k3batch.io.resolve import InputFile
from k3batch.io.sink import ShardSink

MANIFEST_NAME = "_k3batch_manifest.json"
MANIFEST_VERSION = 1

_log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    job_fingerprint: str  # hash of what defines the job's results (given by the driver)
    job_description: dict  # human-readable: model, input, sampling... (given by the driver)
    # [{"uri", "path", "size_bytes", "format" (absent: parquet)}] in index order, fixed at first
    # start
    input_files: list[dict]
    batch_rows: int  # rows per unit, fixed at first start
    created_at: str  # ISO 8601, UTC
    version: int = MANIFEST_VERSION
    # What the input must look like, from the first valid file at the first start (given by the
    # driver); None until recorded. Each input_files entry also gets "num_rows" then (None for a
    # file unreadable at the first start): what the end-of-run completeness check counts against.
    input_schema: dict | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, *, where: str) -> Manifest:
        """Parse a manifest read from `where`; ValueError naming it if malformed."""
        names = {f.name for f in dataclasses.fields(cls)}
        required = names - {"version", "input_schema"}
        if not isinstance(data, dict) or not required <= data.keys():
            missing = sorted(required - data.keys()) if isinstance(data, dict) else "all"
            raise ValueError(f"malformed manifest {where}: missing keys {missing}")
        version = data.get("version", MANIFEST_VERSION)
        if version != MANIFEST_VERSION:
            raise ValueError(
                f"manifest {where} has version {version}, this k3batch reads {MANIFEST_VERSION}"
            )
        for i, f in enumerate(data["input_files"]):
            if not isinstance(f, dict) or not {"uri", "path", "size_bytes"} <= f.keys():
                raise ValueError(f"malformed manifest {where}: input_files[{i}] = {f!r}")
        if not isinstance(data["batch_rows"], int) or data["batch_rows"] < 1:
            raise ValueError(f"malformed manifest {where}: batch_rows = {data['batch_rows']!r}")
        return cls(**{k: v for k, v in data.items() if k in names})

    def num_rows(self) -> list[int | None] | None:
        """Recorded row count per input file (None where unreadable then), or None if the
        counts were never recorded (see `record_inputs`)."""
        if self.input_schema is None:
            return None
        return [f.get("num_rows") for f in self.input_files]

    def files(self) -> list[InputFile]:
        """The recorded input files as InputFile, indexed in recorded order."""
        return [
            InputFile(path=f["path"], uri=f["uri"], size_bytes=int(f["size_bytes"]), index=i,
                      format=f.get("format", "parquet"))  # fmt: skip
            for i, f in enumerate(self.input_files)
        ]


def open_manifest(
    sink: ShardSink,
    *,
    fingerprint: str,
    description: dict,
    files: list[InputFile],
    batch_rows: int,
) -> tuple[Manifest, list[InputFile]]:
    """Create or resume the manifest of the job writing to `sink`.

    files: the current listing of the input (from `resolve_input`); batch_rows: the batch size
    to use if the job starts now. Returns (manifest, the files to process). On resume these are
    the recorded files and `manifest.batch_rows` is the recorded batch size, whatever is passed.
    Raises ValueError if the directory holds another job's results (different fingerprint),
    shards without a manifest, or if a recorded input file is missing or changed size.
    """
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be positive, got {batch_rows}")
    where = f"{sink.uri.rstrip('/')}/{MANIFEST_NAME}"
    data = sink.read_json(MANIFEST_NAME)

    if data is None:
        num_shards = len(sink.committed())
        if num_shards:
            raise ValueError(
                f"output dir {sink.uri!r} holds {num_shards} committed shards but no "
                f"{MANIFEST_NAME}: refusing to mix this job's results with unknown ones; "
                f"choose another output dir"
            )
        manifest = Manifest(
            job_fingerprint=fingerprint,
            job_description=description,
            input_files=[_file_entry(f) for f in files],
            batch_rows=batch_rows,
            created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        )
        sink.write_json(MANIFEST_NAME, manifest.to_dict())
        return manifest, [dataclasses.replace(f, index=i) for i, f in enumerate(files)]

    manifest = Manifest.from_dict(data, where=where)
    if manifest.job_fingerprint != fingerprint:
        raise ValueError(
            f"output dir {sink.uri!r} holds results of a different job (fingerprint "
            f"{manifest.job_fingerprint[:16]} there, {fingerprint[:16]} now); "
            f"{_describe_diff(manifest.job_description, description)}; "
            f"choose another output dir"
        )
    if batch_rows != manifest.batch_rows:
        _log.info(
            "resuming with the recorded batch_rows=%d (not %d)", manifest.batch_rows, batch_rows
        )

    current = {f.path: f for f in files}
    for f in manifest.files():
        now = current.get(f.path)
        if now is None:
            raise ValueError(
                f"input file {f.uri} of the job in {sink.uri!r} is missing now: the input "
                f"changed under a running job"
            )
        if now.size_bytes != f.size_bytes:
            raise ValueError(
                f"input file {f.uri} changed size ({f.size_bytes} bytes at the job's start, "
                f"{now.size_bytes} now): the input changed under a running job"
            )
    recorded = {f["path"] for f in manifest.input_files}
    num_new = sum(1 for p in current if p not in recorded)
    if num_new:
        _log.warning(
            "%d input files appeared since the job started; they are not processed "
            "(the job keeps its original file list)",
            num_new,
        )
    return manifest, manifest.files()


def _file_entry(f: InputFile) -> dict:
    entry = {"uri": f.uri, "path": f.path, "size_bytes": f.size_bytes}
    if f.format != "parquet":  # manifests of Parquet jobs stay as they were
        entry["format"] = f.format
    return entry


def record_inputs(
    sink: ShardSink, manifest: Manifest, *, num_rows: list[int | None], input_schema: dict
) -> Manifest:
    """Record the input's row counts and schema contract in the manifest, once: a manifest that
    holds them already is returned as is (the first start's facts stay the reference)."""
    if manifest.input_schema is not None:
        return manifest
    if len(num_rows) != len(manifest.input_files):
        raise ValueError(f"{len(num_rows)} row counts for {len(manifest.input_files)} files")
    files = [f | {"num_rows": n} for f, n in zip(manifest.input_files, num_rows)]
    manifest = dataclasses.replace(manifest, input_files=files, input_schema=input_schema)
    sink.write_json(MANIFEST_NAME, manifest.to_dict())
    return manifest


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _describe_diff(old: dict, new: dict) -> str:
    """'differing settings: model: 'a' there, 'b' now; ...' over dotted keys."""
    a, b = _flatten(old), _flatten(new)
    missing = object()
    diffs = []
    for key in sorted(a.keys() | b.keys()):
        va, vb = a.get(key, missing), b.get(key, missing)
        if va != vb:
            there = "(unset)" if va is missing else repr(va)
            now = "(unset)" if vb is missing else repr(vb)
            diffs.append(f"{key}: {there} there, {now} now")
    if not diffs:
        return "the descriptions are identical, so they differ in settings not described"
    return "differing settings: " + "; ".join(diffs)
