"""Benchmarks and load generation: `pagedjax bench serve | sweep | offline | ...`.

loadgen.py  -- workloads (scenarios) and the async OpenAI streaming load generator
report.py   -- statistics, JSON/text reports and plots
machine.py  -- the machine a result was measured on (recorded in every result JSON)
offline.py  -- the engine's in-process benchmarks (host step, throughput, decode split)
cli.py      -- argparse wiring (`add_bench_parser`)
"""
