"""FLOPs and bytes of one train step per device, from XLA's cost analysis, and the roofline time they imply.

XLA's cost analysis counts the body of a loop once, whatever its trip count: a scanned 24-layer step reports
the FLOPs of a 4-layer one, and the LM head's chunk loop (`trainer.logprob_chunk`) is counted for one chunk.
So `step_cost` does not read the full program's analysis. It compiles the same step twice more, unrolled at 1
and 2 layers, with one micro-batch of one row per batch shard and the whole sequence as a single logprob chunk
(loops of one trip, which XLA removes; one row keeps the compile of a whole row's full-vocabulary logits small),
and reads the per-layer figures as the difference: flops(L) = flops(1) + (L - 1) x (flops(2) - flops(1)). FLOPs
grow with the rows and micro-batches of a step, so they are multiplied by both (the optimizer update, counted
once per row this way, is a small elementwise term). Bytes do not: the weights are read once per micro-batch
whatever its rows, so bytes x micro-batches is a lower bound and bytes x micro-batches x rows an upper bound;
the roofline uses the lower one, so that it stays a lower bound on the step time. The figures are per device:
the analysed program is the SPMD-partitioned one. XLA:TPU's partitioner makes loops of its own: a matmul whose
weights are all-gathered over fsdp (or whose result is reduce-scattered) becomes a windowed einsum, a loop over
the weight's shards that overlaps the transfers with the matmul (14 such loops in one QwQ-32B layer on v5p-128),
and the analysis counts one shard's piece of it. The cost compiles turn windowed einsums off (`COST_OPTIONS`; the
same FLOPs, computed without overlap), and `loops` counts whatever loops remain in them (0 for this learner's
step): with any left, the FLOPs are a lower bound.

What the cost analysis leaves out: custom calls, among them the Pallas kernels (splash attention's Mosaic
`tpu_custom_call`s count 0 FLOPs and 0 bytes). `attention_flops` estimates what splash computes: per row and
layer, QK^T and PV over the causal half of the [seq, seq] blocks is 2 x seq^2 x heads x head_dim FLOPs
forward; the backward recomputes the scores and forms dQ, dK, dV (2.5x the forward), and remat recomputes the
forward once more. The roofline time is max(FLOPs / peak, bytes / HBM bandwidth) per chip: no collective, no
host transfer, no overlap losses, so real steps take longer.
"""

from __future__ import annotations

import dataclasses

MOSAIC_CALL = "tpu_custom_call"  # how a Pallas TPU kernel appears in the compiled HLO
COST_OPTIONS = {  # XLA:TPU options of the cost compiles: no windowed einsum loops (module docstring)
    "xla_tpu_enable_windowed_einsum_for_all_gather": False,
    "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False,
}


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Per-device figures of one step (`micro_batches` micro-batches of `rows` rows per device, `layers` layers)."""

    flops: float
    bytes: float  # a lower bound: per micro-batch, as if it had one row (module docstring)
    bytes_high: float  # an upper bound: every row reads the weights again
    layer_flops: float  # one layer of one row: forward, backward and recompute
    layers: int
    micro_batches: int
    rows: int
    attention_flops: float = 0.0  # the Pallas attention kernels' FLOPs, estimated (not in `flops`)

    def roofline_s(self, peak_flops: float, bandwidth: float, with_kernels: bool = False) -> float:
        """max(compute time, memory time) on a chip of `peak_flops` FLOP/s and `bandwidth` bytes/s."""
        flops = self.flops + (self.attention_flops if with_kernels else 0.0)
        return max(flops / peak_flops, self.bytes / bandwidth)


def analysed(compiled) -> tuple[float, float]:
    """(flops, bytes accessed) of a compiled program's cost analysis (a dict, or a list of one per program)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0]
    return float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))


def loops(compiled) -> int:
    """How many while loops the compiled program holds (each one's body is counted once by the cost analysis)."""
    return compiled.as_text().count(" while(")


def mosaic_calls(compiled) -> int:
    """How many Pallas (Mosaic) kernel calls the compiled program holds."""
    return compiled.as_text().count(f'custom_call_target="{MOSAIC_CALL}"')


def scale_layers(
    one: tuple[float, float], two: tuple[float, float], layers: int, micro_batches: int, rows: int = 1
) -> StepCost:
    """The step's cost from the analyses of its 1- and 2-layer unrolled copies of one row per device."""
    layer_flops, layer_bytes = two[0] - one[0], two[1] - one[1]
    per_row_bytes = one[1] + (layers - 1) * layer_bytes
    return StepCost(
        flops=micro_batches * rows * (one[0] + (layers - 1) * layer_flops),
        bytes=micro_batches * per_row_bytes,
        bytes_high=micro_batches * rows * per_row_bytes,
        layer_flops=layer_flops,
        layers=layers,
        micro_batches=micro_batches,
        rows=rows,
    )


def splash_flops(
    rows_per_device: int, seq_len: int, heads_per_device: int, head_dim: int, layers: int, remat: bool
) -> float:
    """Estimated FLOPs of causal splash attention for one micro-batch per device (module docstring)."""
    forward = 2.0 * seq_len * seq_len * heads_per_device * head_dim * rows_per_device
    passes = 1.0 + 2.5 + (1.0 if remat else 0.0)
    return forward * passes * layers
