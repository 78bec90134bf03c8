"""The layout planner: which D×P×T, tensor mode, ZeRO stage, recompute and micro-batch to use.

Pure functions, no process groups (except :mod:`.calibrate` and :mod:`.calibrate_reference`,
which measure this machine); one is memoised (a rank's parameter blocks, keyed by :mod:`.memo`).
Every byte and FLOP comes from :mod:`gridshard.theory`; this package enumerates layouts
(:mod:`.layouts`), prices them with a hardware model (:mod:`.hardware`, :mod:`.cost_memory`,
:mod:`.cost_time`), ranks them (:mod:`.search`) and reports (:mod:`.report`). Docs: docs/planner.md.
"""
from .hardware import Hardware, load_hardware, builtin_hardware
from .layouts import Layout, enumerate_layouts, layout_problem
from .search import Candidate, PlanError, PlanResult, evaluate, plan

__all__ = ["plan", "evaluate", "PlanResult", "Candidate", "PlanError", "Layout", "enumerate_layouts",
           "layout_problem", "Hardware", "load_hardware", "builtin_hardware"]
