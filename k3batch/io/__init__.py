"""Parquet input and output for batch jobs: `source` (input files -> deterministic units),
`sink` (atomically committed output shards), `manifest` (what makes a resume safe)."""

from k3batch.io.manifest import MANIFEST_NAME, Manifest, open_manifest
from k3batch.io.sink import ShardSink, shard_name
from k3batch.io.source import InputFile, Unit, count_rows, iter_units, resolve_input

__all__ = [
    "MANIFEST_NAME",
    "InputFile",
    "Manifest",
    "ShardSink",
    "Unit",
    "count_rows",
    "iter_units",
    "open_manifest",
    "resolve_input",
    "shard_name",
]
