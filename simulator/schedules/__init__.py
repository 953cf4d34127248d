"""Pipeline schedules as data: generators, a text format, static checks and analysis.

See ``base`` for the data model and the dependency rule, ``registry.build_schedule`` for the
named schedules, ``text`` for the torchtitan CSV format.
"""

from simulator.schedules.analysis import (
    UnitCostReplay,
    makespan_unit_costs,
    peak_activations,
    replay_action_costs,
    replay_unit_costs,
)
from simulator.schedules.base import Action, PipelineSchedule, required_inputs
from simulator.schedules.registry import SCHEDULES, build_schedule, schedule_names
from simulator.schedules.text import format_schedule_csv, load_schedule_csv, parse_schedule_csv, save_schedule_csv
from simulator.schedules.validate import validate_schedule

__all__ = [
    "Action",
    "PipelineSchedule",
    "required_inputs",
    "SCHEDULES",
    "build_schedule",
    "schedule_names",
    "validate_schedule",
    "UnitCostReplay",
    "replay_unit_costs",
    "replay_action_costs",
    "makespan_unit_costs",
    "peak_activations",
    "load_schedule_csv",
    "save_schedule_csv",
    "parse_schedule_csv",
    "format_schedule_csv",
]
