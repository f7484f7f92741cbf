"""Green-context SM partitions and driver-API CUDA graphs with partition-bound kernel nodes."""

from megamoe_rt.graph.partition import PartitionPlan, plan_partitions, valid_counts
from megamoe_rt.graph.spec import NodeSpec, PipelineSpec, SpecError, load_spec, parse_spec

__all__ = [
    "NodeSpec",
    "PartitionPlan",
    "PipelineSpec",
    "SpecError",
    "load_spec",
    "parse_spec",
    "plan_partitions",
    "valid_counts",
]
