"""Continuous batching over pagedkv: request queue, scheduler, model runner, sampling, `generate()`.

The step is an explicit data contract, a plain dataclass handed from one stage to the next:
`Scheduler.schedule() -> SchedulerOutput`, the runner
executes it on a model, `Scheduler.update(output, sampled, now)` applies the sampled tokens. The scheduler
(`scheduler.py`, `request.py`) is torch-free and knows nothing about models, so the simulator drives the
same one; the runner, sampler and `Engine` (torch) live in their own modules.

Nothing is imported eagerly: `import pagedkv.engine` loads neither torch nor transformers.
"""

from __future__ import annotations
