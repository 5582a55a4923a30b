"""Planning: predict a cluster's throughput per method before renting it.

``editrain plan`` answers, for a cluster (nodes, GPUs, compute speed, links, stragglers), a
model and method settings: step time, tokens/s, utilisation (compute time / wall time),
exposed communication, bytes per round and memory per GPU; ``--target`` searches the
cheapest setting reaching a utilisation; ``--calibrate`` fits the compute speed and the
link from a run's metrics. ``docs/planning.md`` describes the model and its limits.

=============== ========================================================================
``inputs``      the cluster, model and method settings, validated (one-line errors)
``model``       the job model: units, link costs, the round timeline, memory, predict()
``search``      the cheapest setting for a target; the bandwidth a setting needs
``calibrate``   compute speed, overhead, stragglers and link fitted to runs' metrics
``cli``         the ``editrain plan`` sub-command (table, JSON, plot)
=============== ========================================================================
"""

from editrain.plan.inputs import Cluster, MethodSpec, ModelSpec, PlanInputs, load_inputs
from editrain.plan.model import Prediction, model_shape, predict

__all__ = ["Cluster", "MethodSpec", "ModelSpec", "PlanInputs", "Prediction", "load_inputs",
           "model_shape", "predict"]
