"""gpushare benchmarks: speed, scale and packing quality, each beside a baseline measured in the same run.

`python -m bench [--full] [--only NAME,...] [--out bench/results]` runs the suite (see docs/benchmarks.md).
Each benchmark module exposes `NAME`, `TITLE` and `async def run(ctx) -> BenchResult`.
"""
