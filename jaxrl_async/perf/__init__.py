"""Performance model and simulator: choose the sampler/trainer device split before paying for it.

Modules: `hardware` (device rooflines), `shapes` (model FLOPs and bytes), `workload` (batch and length
distributions), `latency` (decode step time t(b) and its fit), `system` (what is evaluated), `model`
(analytic rates and staleness per split), `simulator` (discrete-event check), `shared_host` (both roles on
the same cores, from role benches), `scenario` and `report` (files in and out). Everything here is
analytic: nothing compiles a step (`jaxrl_async.runtime.plan_check` compiles the train and decode steps for a
target mesh and reads their per-device memory).
"""
