"""Dry-run plans: what the compiler will do, what it will move, and what it will hold -- without GPUs.

    plan = autoshard.plan(model, (input_ids,), world_size=64)      # the model and inputs may be on meta
    print(plan)                                                    # summary, then one row per layer
    plan.attention[0].strategy, plan.attention[0].costs, plan.attention[0].reason
    sum(c.bytes_per_rank for c in plan.collectives)                # what rank 0 sends, forward + backward
    plan.memory_per_rank.total, plan.memory_per_rank.formula
    Plan.from_json(plan.to_json()) == plan;  plan.to_dot()

How: dynamo captures the model's graphs (meta tensors as fake ones: nothing is computed), the compiler's passes
run for one rank of a *plan group* (a stand-in with a rank and a size; nothing communicates), every
collective the rewrite emits is recorded with every rank's bytes and a sympy formula
(:mod:`autoshard.passes.comms`), the per-rank graph runs forward and backward on fake tensors to follow what it
holds, and the cost model (:mod:`autoshard.cost`) prices every attention strategy on the given topology. The same
fake run prices every op on that hardware profile: the step's time, by layer (:mod:`autoshard.step_time`,
``plan(..., hardware="h100")``).

One module per part:

* :mod:`.result` -- the :class:`Plan` and its parts, and how they read (text, JSON, Graphviz);
* :mod:`.capture` -- dynamo's graph calls of a model (meta tensors as fake CPU ones), and the values handed from
  one graph to the next;
* :mod:`.memory` -- the memory simulator: the live bytes of a per-rank graph run forward and backward on fake
  tensors, and the working sets of the ops whose fake implementations do not show them;
* :mod:`.fsdp` -- the step around the graphs: FSDP2's shards and gathers and the optimizer's states, added up with
  the graphs' peaks into the step's memory, and the step's time;
* :mod:`.orchestrate` -- :func:`plan`, :func:`plan_graphs`: the graph calls planned in order, step by step;
* :mod:`.decode` -- :func:`plan_decode`: the decode step after a prompt (serving).

The memory policy (``memory_budget``) chooses each graph's levers from plans of the graph
(:func:`autoshard.policy.memory_policy_for`).
"""

from .decode import DecodePlan, plan_decode
from .orchestrate import plan, plan_graph, plan_graphs
from .result import AttentionDecision, Collective, MemoryEstimate, Plan, PlanFallback

__all__ = ["Plan", "AttentionDecision", "Collective", "MemoryEstimate", "PlanFallback", "plan", "plan_graph",
           "plan_graphs", "DecodePlan", "plan_decode"]
