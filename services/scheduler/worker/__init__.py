"""The model worker: one step's plan run on the device (`worker.py`), laid out on the host
(`layout.py`), its logprob rows asked for (`logprob_asks.py`), its sampled tokens kept on the
device for the next step (`token_pool.py`), and its one readback turned into results (`readback.py`)."""

from services.scheduler.worker.worker import LaunchedStep, ModelWorker, WorkerOptions

__all__ = ["LaunchedStep", "ModelWorker", "WorkerOptions"]
