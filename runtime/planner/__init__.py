"""Capacity planner behind `pagedjax plan`: core.py holds the memory-bandwidth model of
decode (profiles, formulas, the plan and its table), disagg.py the prefill/decode pool
split, tp.py the tensor-parallel table, cli.py the command."""

from runtime.planner.cli import add_plan_arguments, run_plan
from runtime.planner.core import (DEVICE_NAMES, DEVICES, GB, MODELS, WEIGHT_DTYPE_BYTES, CapacityPlan,
                                  DeviceProfile, device_profile, fleet_size, format_plan, measure_cpu,
                                  normalize_dtype, plan, plot_plan, step_time_s, tokens_per_s)
from runtime.planner.disagg import DisaggPlan, format_disagg, plan_disagg
from runtime.planner.tp import TPRow, allreduce_s, format_tp, plan_tp

__all__ = ["DEVICE_NAMES", "DEVICES", "GB", "MODELS", "WEIGHT_DTYPE_BYTES", "CapacityPlan", "DeviceProfile", "DisaggPlan", "TPRow", "add_plan_arguments",
           "allreduce_s", "device_profile", "fleet_size", "format_disagg", "format_plan", "format_tp",
           "measure_cpu", "normalize_dtype", "plan", "plan_disagg", "plan_tp", "plot_plan", "run_plan",
           "step_time_s", "tokens_per_s"]
