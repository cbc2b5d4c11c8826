"""The scheduler service (`python -m services.scheduler`, `sparkwire scheduler`).

Importing this package, which every scheduler process does before torch loads, gives OpenMP the
passive wait policy unless the environment already names one. With libgomp's default active wait
the step thread (step_loop.py) and its OpenMP worker spin between and at the end of every parallel
region, and as steps run back to back they never sleep: two schedulers on two cores then held four
spinning threads, and each op waited for a preemption (far fewer tokens, each for more CPU).
libgomp reads the variable once, when it loads, so it is set here.
"""

import os

OPENMP_WAIT_POLICY = "PASSIVE"

os.environ.setdefault("OMP_WAIT_POLICY", OPENMP_WAIT_POLICY)
