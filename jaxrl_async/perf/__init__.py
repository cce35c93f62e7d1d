"""Performance model and simulator: choose the sampler/trainer device split before paying for it.

Modules: `hardware` (device rooflines), `shapes` (model FLOPs and bytes), `workload` (batch and length
distributions), `latency` (decode step time t(b) and its fit), `system` (what is evaluated), `model`
(analytic rates and staleness per split), `simulator` (discrete-event check), `scenario` and `report`
(files in and out). A `plan_check` module (compile the train and decode steps for a target mesh on
abstract arrays and read per-device memory) belongs here once the model, trainer and sampler exist.
"""
