"""The asynchronous RL runtime: the only package that knows processes, messages and every library.

The libraries below it (`model/`, `data/`, `sampler/`, `rewards/`, `trainer/`, `rollouts.py`,
`sharding.py`, `tokenizer.py`) know nothing of processes; this package joins them. Data flows one way:

    coordinator (prompts, η admission)
        -> actor (sampler.SamplerLoop decodes; rewards.RewardService grades)   runtime/actor.py
        -> learner (trainer.train_step on the trainer mesh)                     runtime/learner.py
        -> weight sync (trainer layout -> sampler layout, versioned)            runtime/weight_sync.py
        -> actor (in-flight update between two decode calls)

Layers, top to bottom (no module imports one above it):
  orchestrator, calibration, plan_check   a process's event loop; role timing; compile-before-you-pay
  build, weight_roles                     puts the roles of one process together from a RunConfig (and
                                          which weight publisher and receiver each process gets)
  actor, replica, learner, coordinator    the roles: each a non-blocking `poll()`
  eval_schedule, tickets, rollout_groups, the roles' parts: actor 0's evaluations, prompt grants, groups
  arrivals, learner_log                   being graded, versions in transit; the learner's bookkeeping
  lora_sync, weight_sync, checkpoint,     what the roles use (lora_sync: a LoRA run's base once, then
  metrics, evaluation                     adapters, over weight_sync's channels)
  transport                               messages between roles: in memory, or ZeroMQ between processes
  codec, messages                         the wire format, the message types
  cluster                                 `jax.distributed` start-up, roles of processes, failure reports
  secret, errors                          the run's signing key; the error of a wrong process layout
"""
