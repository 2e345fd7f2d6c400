"""``spill tune``: a LoRA run whose every optimizer step can be the last (``job``), its options,
the identity a checkpoint must share to be continued, the step's gradients at any world size,
the validation loss and the training rows."""

from spill.jobs.tune.job import tune
from spill.jobs.tune.options import TuneOptions

__all__ = ["TuneOptions", "tune"]
