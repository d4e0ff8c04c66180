"""Benchmarks and load generation: `pagedjax bench serve | sweep | offline | render`.

loadgen.py  -- workloads (scenarios) and the async OpenAI streaming load generator
report.py   -- statistics, JSON/text reports, plots and the BENCHMARKS.md renderer
offline.py  -- the engine's in-process benchmarks (host step, throughput, decode split)
cli.py      -- argparse wiring (`add_bench_parser`)
"""
