"""Benchmarks and rooflines: the instruments, not the product. Numbers are printed, never
asserted; nothing below `bench/` imports it.

Modules: `cli` (the `k3batch bench` command group), `engine` (`bench pipeline`, `bench engine`:
the single-device engine), `moe` (the routed experts), `kernels` (attention kernels alone),
`layouts` (PP against TP prefill, DCP decode, on N devices), `host` (the engine's host side
alone), `job` (the batch job end to end against the engine), `roofline` (the least time a piece
of work needs on one H200), `driver` (the driver's memory and time at scale: `python -m
k3batch.bench.driver`), `elastic` (an elastic job on a simulated autoscaling cluster: `python -m
k3batch.bench.elastic`).
"""
