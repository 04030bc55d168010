"""benchmarks/shardcast.py reports our figures when the reference could not be installed or run (it stopped
with KeyError 'reference_best_s' before)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))  # its `_common`
SPEC = importlib.util.spec_from_file_location(
    "shardcast_bench", Path(__file__).resolve().parents[3] / "benchmarks" / "shardcast.py"
)
bench = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(bench)


def run(seconds: float) -> dict:
    return {"end_to_end_s": seconds, "per_client_mb_s": [400.0]}


def test_summary_without_the_reference():
    entry = {"ours": [run(2.5), run(2.6)], "ours_no_fsync": [run(2.0)], "reference": "not run: no wget"}
    bench.summarize(entry, 4000.0)
    assert entry["ours_best_s"] == 2.5 and entry["ours_no_fsync_best_s"] == 2.0
    assert "ours_speedup_best_vs_best" not in entry


def test_summary_with_the_reference():
    entry = {"ours": [run(2.0)], "ours_no_fsync": [run(1.0)], "reference": [run(6.0)]}
    bench.summarize(entry, 4000.0)
    assert entry["ours_speedup_best_vs_best"] == 3.0 and entry["ours_no_fsync_speedup_best_vs_best"] == 6.0


def test_summary_when_every_reference_run_failed():
    entry = {"ours": [run(2.0)], "ours_no_fsync": [run(1.0)], "reference": [], "reference_errors": ["boom"]}
    bench.summarize(entry, 4000.0)
    assert entry["ours_best_s"] == 2.0 and "ours_speedup_best_vs_best" not in entry


def test_pipelined_and_store_and_forward_side_by_side_and_chain_ratios():
    report = {
        "topologies": {
            "origin->2 relays->1 clients": {
                "ours": [run(1.0), run(1.2), run(1.1)],
                "ours_store_and_forward": [run(2.0), run(2.2), run(2.4)],
            },
            "chain depth 1: origin->1 relay(s) in a chain->1 client": {
                "ours": [run(1.0)],
                "ours_store_and_forward": [run(1.5)],
            },
            "chain depth 3: origin->3 relay(s) in a chain->1 client": {
                "ours": [run(1.2)],
                "ours_store_and_forward": [run(4.5)],
            },
        }
    }
    for entry in report["topologies"].values():
        bench.summarize(entry, 4000.0)
    bench.compare_modes(report)
    side = report["pipelined_vs_store_and_forward"]["origin->2 relays->1 clients"]
    assert side["pipelined_median_s"] == 1.1 and side["store_and_forward_median_s"] == 2.2
    assert side["speedup_median"] == 2.0
    assert report["chain_depth_over_depth_1"] == {"pipelined": {"depth_3": 1.2}, "store_and_forward": {"depth_3": 3.0}}
