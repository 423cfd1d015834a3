"""Input and output for batch jobs: `resolve` (an input spec -> its files), `source` (files ->
deterministic units), `sink` (atomically committed output shards), `manifest` (what makes a
resume safe), `lease` (one job per output directory)."""

from k3batch.io.lease import LEASE_NAME, LeaseHeldError, OutputLease
from k3batch.io.manifest import MANIFEST_NAME, Manifest, open_manifest, record_inputs
from k3batch.io.resolve import InputFile, resolve_input
from k3batch.io.sink import ShardSink, shard_name
from k3batch.io.source import Unit, count_rows, iter_units

__all__ = [
    "LEASE_NAME",
    "LeaseHeldError",
    "MANIFEST_NAME",
    "InputFile",
    "Manifest",
    "OutputLease",
    "ShardSink",
    "Unit",
    "count_rows",
    "iter_units",
    "open_manifest",
    "record_inputs",
    "resolve_input",
    "shard_name",
]
